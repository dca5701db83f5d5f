"""Server-sent events in OpenAI's framing, and the per-choice bookkeeping of a stream.

A stream asks the engine for DELTA outputs: each carries, per choice, only the text, tokens and logprobs that are
new (choices with nothing new are left out). What a chunk still needs from earlier ones — where this choice's text
starts (completions' text offsets), whether it is its first chunk (echo), the prompt logprobs (first output only),
and the token counts for `usage` — is kept here.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass

from jpaged_server.errors import APIError, error_body
from jpaged_server.generation import GenerationStopped
from jpaged_server.protocol import PromptTokensDetails, UsageInfo
from pydantic import BaseModel

from jpaged.outputs import CompletionOutput, RequestOutput

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of the stream


def sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def sse_error(status: int, message: str) -> str:
    """An error after the stream began (status 200 is already sent): one error event, as vLLM and OpenAI do."""
    return f"data: {json.dumps(error_body(status, message))}\n\n"


async def end_stream(outputs: AsyncGenerator, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """`events`, then [DONE]. A generation stopped (shutdown) or failed mid-stream ends with one error event and
    [DONE] — or nothing more when the client is gone — and the engine streams in `outputs` are closed whatever
    happens."""
    try:
        async for event in events:
            yield event
        yield DONE
    except GenerationStopped as stopped:
        if not stopped.client_gone:
            yield sse_error(503, str(stopped))
            yield DONE
    except APIError as err:
        yield sse_error(err.status, err.message)
        yield DONE
    finally:
        await outputs.aclose()


@dataclass(slots=True)
class Delta:
    """One choice's new output, and where it stands in the choice's whole text."""

    choice: CompletionOutput  # text, token_ids and logprobs: only what is new
    text_offset: int  # characters of this choice sent before
    first: bool  # nothing was sent for this choice before


class StreamTracker:
    """Per (prompt, choice): characters and tokens sent, and whether its finish was reported; per prompt, its first
    output (the only one with prompt logprobs)."""

    def __init__(self) -> None:
        self._sent: dict[tuple[int, int], tuple[int, int]] = {}
        self._finished: set[tuple[int, int]] = set()
        self.first_outputs: dict[int, RequestOutput] = {}

    def deltas(self, prompt_index: int, output: RequestOutput) -> Iterator[Delta]:
        """The choices of a DELTA `output` that have something to send, in choice order."""
        self.first_outputs.setdefault(prompt_index, output)
        for choice in sorted(output.outputs, key=lambda c: c.index):
            key = (prompt_index, choice.index)
            if key in self._finished:
                continue
            first = key not in self._sent
            num_chars, num_tokens = self._sent.get(key, (0, 0))
            if not choice.text and not choice.token_ids and choice.finish_reason is None and not first:
                continue
            self._sent[key] = (num_chars + len(choice.text), num_tokens + len(choice.token_ids))
            if choice.finish_reason is not None:
                self._finished.add(key)
            yield Delta(choice, num_chars, first)

    def usage(self) -> UsageInfo:
        completion = sum(num_tokens for _, num_tokens in self._sent.values())
        return usage_info(self.first_outputs.values(), completion)


def usage_of(outputs) -> UsageInfo:
    """Token counts of whole (FINAL_ONLY) outputs."""
    outputs = list(outputs)
    return usage_info(outputs, sum(len(c.token_ids) for o in outputs for c in o.outputs))


def usage_info(outputs, completion_tokens: int) -> UsageInfo:
    """`usage` for the prompts of `outputs` (one per prompt) and the tokens generated for them; the prompt
    tokens the prefix cache served are its cached_tokens."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion_tokens,
        total_tokens=prompt + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )
