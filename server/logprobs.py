"""The engine's per-token logprob dicts in the two OpenAI shapes: legacy completions and chat.

Each engine entry maps token id -> Logprob for the sampled token (with its true rank) and the top-k tokens.
"""

from __future__ import annotations

from jpaged_server.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)

from jpaged.outputs import Logprob, RequestOutput

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps to this too


def _value(logprob: Logprob) -> float:
    return max(logprob.logprob, MIN_LOGPROB)


def _token(logprob: Logprob) -> str:
    return logprob.decoded_token or ""


def completion_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], text_offset: int
) -> CompletionLogprobs:
    """Legacy shape: parallel lists; `text_offset` is where the first of these tokens starts in the choice text."""
    result = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries, strict=True):
        sampled = entry[token_id]
        result.tokens.append(_token(sampled))
        result.token_logprobs.append(_value(sampled))
        result.top_logprobs.append({_token(lp): _value(lp) for lp in entry.values()})
        result.text_offset.append(text_offset)
        text_offset += len(_token(sampled))
    return result


def echoed_prompt_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob] | None], tokens: list[str]
) -> CompletionLogprobs:
    """The prompt's part of `echo` with `logprobs`: the first token has no logprob (nothing precedes it)."""
    result = CompletionLogprobs()
    offset = 0
    for token_id, entry, text in zip(token_ids, entries, tokens, strict=True):
        result.tokens.append(text)
        result.text_offset.append(offset)
        result.token_logprobs.append(None if entry is None else _value(entry[token_id]))
        result.top_logprobs.append(
            None if entry is None else {_token(lp): _value(lp) for lp in entry.values()}
        )
        offset += len(text)
    return result


def join_logprobs(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        text_offset=first.text_offset + second.text_offset,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        tokens=first.tokens + second.tokens,
        top_logprobs=first.top_logprobs + second.top_logprobs,
    )


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        sampled = entry[token_id]
        top = sorted(
            (lp for lp in entry.values() if lp.rank is not None and lp.rank <= num_top),
            key=lambda lp: lp.rank,
        )
        content.append(
            TokenLogprob(
                token=_token(sampled),
                logprob=_value(sampled),
                bytes=list(_token(sampled).encode()),
                top_logprobs=[
                    TopLogprob(token=_token(lp), logprob=_value(lp), bytes=list(_token(lp).encode()))
                    for lp in top
                ],
            )
        )
    return ChatLogprobs(content=content)


def vllm_prompt_logprobs(output: RequestOutput) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: per prompt position, None for the first, else token id -> logprob, rank and
    decoded token (the prompt's own token and the top ones asked for)."""
    return [
        None
        if entry is None
        else {
            token_id: PromptLogprob(logprob=_value(lp), rank=lp.rank, decoded_token=lp.decoded_token)
            for token_id, lp in entry.items()
        }
        for entry in output.prompt_logprobs or [None] * len(output.prompt_token_ids)
    ]
