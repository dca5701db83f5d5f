"""From an API request to engine inputs: SamplingParams, token budget and up-front validation.

Everything the engine would reject is checked here, before a streaming response commits to status 200, so bad
input is always a 400 rather than an error event in the middle of a stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jpaged_server.errors import APIError, bad_request
from jpaged_server.protocol import SamplingRequest

from jpaged.engine.llm_engine import LLMEngine
from jpaged.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def resolve_max_tokens(
    requested: int | None,
    default: int | None,
    prompt_len: int,
    max_model_len: int,
    *,
    param: str,
    prompt_param: str,
) -> int:
    """The output budget: as asked, else `default` (None: the rest of the context), never past max_model_len."""
    if prompt_len >= max_model_len:
        raise APIError(
            400,
            f"the prompt is {prompt_len} tokens long, but this model's maximum context length (max_model_len) is "
            f"{max_model_len} tokens, which must also hold at least one generated token",
            prompt_param,
        )
    room = max_model_len - prompt_len
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise APIError(
            400,
            f"{param}={requested} plus the prompt's {prompt_len} tokens is more than this model's maximum context "
            f"length (max_model_len) of {max_model_len} tokens",
            param,
        )
    return requested


def truncated_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: max_model_len of them)."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    if keep > max_model_len:
        raise APIError(
            400,
            f"truncate_prompt_tokens={keep} is more than this model's maximum context length (max_model_len) of "
            f"{max_model_len} tokens",
            "truncate_prompt_tokens",
        )
    return ids[-keep:] if keep else []


def sampling_params(
    request: SamplingRequest,
    *,
    max_tokens: int,
    logprobs: int | None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """SamplingParams for one prompt of `request`; ValueErrors become 400s naming the field.

    A stream asks the engine for DELTA outputs (only what is new: no copy of the growing token list and text every
    step), a whole response for FINAL_ONLY (one output, its text decoded once at the end: a fraction of the host
    time a step, README's scripts/bench_overhead.py table)."""
    if request.use_beam_search:
        raise APIError(400, "use_beam_search is supported on /v1/completions only", "use_beam_search")
    if request.stream_options is not None and not request.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
    if request.stream and request.prompt_logprobs is not None:  # as vLLM: they belong to a whole response
        raise APIError(400, "prompt_logprobs are not available when stream is true", "prompt_logprobs")
    given = {
        "n": request.n,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "seed": request.seed,
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
        "logit_bias": request.logit_bias,
        "bad_words": request.bad_words,
        "allowed_token_ids": request.allowed_token_ids,
        "prompt_logprobs": request.prompt_logprobs,
    }
    try:
        return SamplingParams(
            **{name: value for name, value in given.items() if value is not None},
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            logprobs=logprobs,
            ignore_eos=request.ignore_eos,
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=structured_outputs,
        )
    except ValueError as err:
        raise bad_request(err, SAMPLING_FIELDS) from None


def check_for_engine(
    engine: LLMEngine,
    prompt_ids: Sequence[int],
    params: SamplingParams | BeamSearchParams,
    prompt_param: str,
) -> None:
    """The engine's own checks (token ids in the vocabulary, n samples or beams within max_num_seqs, a beam width
    its EOS ids and block pool allow), run before anything is queued."""
    try:
        engine.checks.check_prompt(prompt_ids)
    except ValueError as err:
        raise APIError(400, str(err), prompt_param) from None
    if isinstance(params, BeamSearchParams):
        try:
            engine.new_beam_search(len(prompt_ids), params)
        except ValueError as err:
            raise APIError(400, f"n (the beam width): {err}", "n") from None
        return
    try:
        engine.checks.check_params(params)
    except ValueError as err:
        raise bad_request(err, SAMPLING_FIELDS) from None
