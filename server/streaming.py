"""Server-sent events in OpenAI's framing, and the per-choice bookkeeping that turns cumulative outputs into deltas.

The engine's outputs are cumulative (`CompletionOutput.text` holds everything so far); a stream sends each
choice only what it has not sent yet, and its finish reason once.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from pydantic import BaseModel

from jpaged.outputs import CompletionOutput, RequestOutput
from server.errors import APIError, error_body
from server.generation import GenerationStopped
from server.protocol import UsageInfo

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
    """What one choice has newly produced since the last chunk."""

    text: str
    first_token: int  # index into token_ids / logprobs of the first token not yet sent
    token_ids: list[int]
    finish_reason: str | None
    first: bool  # nothing was sent for this choice before


class DeltaTracker:
    """Per (prompt, choice): characters and tokens already sent, and whether its finish was reported."""

    def __init__(self) -> None:
        self._sent: dict[tuple[int, int], tuple[int, int]] = {}
        self._finished: set[tuple[int, int]] = set()
        self.last_outputs: dict[int, RequestOutput] = {}

    def delta(self, prompt_index: int, choice: CompletionOutput) -> Delta | None:
        """The unsent part of `choice`, or None when there is nothing new to send."""
        key = (prompt_index, choice.index)
        if key in self._finished:
            return None
        first = key not in self._sent
        num_chars, num_tokens = self._sent.get(key, (0, 0))
        text, token_ids = choice.text[num_chars:], choice.token_ids[num_tokens:]
        if not text and not token_ids and choice.finish_reason is None and not first:
            return None
        self._sent[key] = (len(choice.text), len(choice.token_ids))
        if choice.finish_reason is not None:
            self._finished.add(key)
        return Delta(text, num_tokens, token_ids, choice.finish_reason, first)

    def usage(self) -> UsageInfo:
        return usage_of(self.last_outputs.values())


def usage_of(outputs) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
