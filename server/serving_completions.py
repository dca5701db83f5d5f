"""POST /v1/completions: raw prompts (text or token ids, one or many), whole or streamed."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jpaged_server.errors import APIError
from jpaged_server.generation import EngineInput, GenerationStopped, generate_outputs, response_id
from jpaged_server.logprobs import (
    completion_logprobs,
    echoed_prompt_logprobs,
    join_logprobs,
    vllm_prompt_logprobs,
)
from jpaged_server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, StreamOptions
from jpaged_server.sampling import check_for_engine, resolve_max_tokens, sampling_params, truncated_prompt
from jpaged_server.state import ServerState, get_state
from jpaged_server.streaming import SSE_HEADERS, StreamTracker, end_stream, sse, usage_of
from jpaged_server.structured_request import check_compiles, requested_spec

from jpaged.outputs import RequestOutput
from jpaged.sampling_params import BeamSearchParams, StructuredOutputsParams

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _prompts(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's four prompt forms as a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty: give a string, a list of strings or token ids", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _engine_inputs(
    state: ServerState, body: CompletionRequest, spec: StructuredOutputsParams | None
) -> tuple[list[EngineInput], list[str]]:
    """Token ids and params of every prompt, validated; and each prompt's text (for echo)."""
    engine = state.engine.engine
    inputs, texts = [], []
    for prompt in _prompts(body.prompt):
        if isinstance(prompt, str):
            ids = engine.tokenizer.encode(prompt, add_special_tokens=body.add_special_tokens)
        else:
            ids = list(prompt)
        kept = truncated_prompt(ids, body.truncate_prompt_tokens, state.max_model_len)
        # The echoed text; decoded once the ids are known to be in the vocabulary, or the prompt as given.
        texts.append(prompt if isinstance(prompt, str) and len(kept) == len(ids) else "")
        ids = kept
        max_tokens = resolve_max_tokens(
            body.max_tokens,
            DEFAULT_MAX_TOKENS,
            len(ids),
            state.max_model_len,
            param="max_tokens",
            prompt_param="prompt",
        )
        if body.use_beam_search:
            params = _beam_search_params(body, max_tokens, spec)
        else:
            params = sampling_params(
                body, max_tokens=max_tokens, logprobs=_engine_logprobs(body), structured_outputs=spec
            )
            if best_of(body) is not None:
                params = dataclasses.replace(params, n=best_of(body))
            if body.echo and body.logprobs is not None:  # the echoed prompt carries its logprobs too
                params = dataclasses.replace(
                    params, prompt_logprobs=max(body.logprobs, body.prompt_logprobs or 0)
                )
        check_for_engine(engine, ids, params, "best_of" if best_of(body) else "prompt")
        if body.echo and not texts[-1]:
            texts[-1] = engine.tokenizer.decode(ids)
        inputs.append(EngineInput(ids, params))
    return inputs, texts


def best_of(body: CompletionRequest) -> int | None:
    """How many samples to draw when `best_of` asks for more than the `n` returned; None otherwise."""
    if body.best_of is None:
        return None
    n = body.n or 1
    if body.best_of < n:
        raise APIError(400, f"best_of must be at least n ({n}), got {body.best_of}", "best_of")
    if body.best_of == n:
        return None
    if body.stream:
        raise APIError(400, "best_of cannot be streamed: the best are known only at the end", "best_of")
    if body.use_beam_search:
        raise APIError(
            400, "best_of cannot be combined with use_beam_search (n is the beam width)", "best_of"
        )
    return body.best_of


def _engine_logprobs(body: CompletionRequest) -> int | None:
    """The logprobs asked for, or the sampled token's own (0) when best_of ranks samples by them."""
    return body.logprobs if body.logprobs is not None or best_of(body) is None else 0


def _best(choices: list, n: int) -> list:
    """The n choices of highest cumulative logprob, renumbered 0..n-1 in that order."""
    ranked = sorted(choices, key=lambda c: -c.cumulative_logprob)[:n]
    return [dataclasses.replace(choice, index=index) for index, choice in enumerate(ranked)]


# Sampling fields a beam search would ignore: refused, not silently dropped.
_NOT_WITH_BEAM_SEARCH = (
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "logprobs",
)


def _beam_search_params(
    body: CompletionRequest, max_tokens: int, spec: StructuredOutputsParams | None
) -> BeamSearchParams:
    """vLLM's semantics: `n` is the beam width and every beam comes back as a choice, best first; under a
    constraint every beam follows it."""
    for name in _NOT_WITH_BEAM_SEARCH:
        if getattr(body, name) is not None:
            raise APIError(400, f"{name} cannot be combined with use_beam_search", name)
    if body.temperature not in (None, 0):
        raise APIError(
            400, "temperature must be 0 with use_beam_search (the search is deterministic)", "temperature"
        )
    if body.min_tokens:
        raise APIError(400, "min_tokens cannot be combined with use_beam_search", "min_tokens")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
    try:
        return BeamSearchParams(body.n or 1, max_tokens, body.length_penalty, body.ignore_eos, spec)
    except ValueError as err:
        field = str(err).split(" ", 1)[0]
        if field == "beam_width":
            raise APIError(400, f"n (the beam width): {err}", "n") from None
        raise APIError(400, str(err), field) from None


async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = get_state(request)
    lora = state.check_model(body.model)
    headers = state.check_fields(body)
    spec = None
    if (constraint := requested_spec(body)) is not None:
        spec, param = constraint
        await check_compiles(state, spec, param)
    inputs, prompt_texts = _engine_inputs(state, body, spec)
    state.admit()
    request_id = response_id("cmpl", body.request_id, request)
    outputs = generate_outputs(
        state,
        request_id,
        inputs,
        request,
        priority=body.priority,
        cache_salt=body.cache_salt,
        lora_request=lora,
    )
    if body.stream:
        options = body.stream_options or StreamOptions()
        events = end_stream(outputs, _stream(state, request_id, body, prompt_texts, outputs, options))
        return StreamingResponse(events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
    return await _whole(state, request_id, body, prompt_texts, outputs, headers)


async def _whole(
    state: ServerState,
    request_id: str,
    body: CompletionRequest,
    prompt_texts: list[str],
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    headers: dict[str, str],
) -> Response:
    finals = {}
    try:
        async for index, output in outputs:
            finals[index] = output
    except GenerationStopped as stopped:
        raise APIError(503, str(stopped)) from None
    choices = []
    n = body.n or 1
    for index in sorted(finals):
        prompt_text = prompt_texts[index] if body.echo else ""
        samples = sorted(finals[index].outputs, key=lambda c: c.index)
        if best_of(body) is not None:
            samples = _best(samples, n)
        for choice in samples:
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(choice.token_ids, choice.logprobs or [], len(prompt_text))
                if body.echo:
                    logprobs = join_logprobs(_prompt_logprobs(state, finals[index]), logprobs)
            choices.append(
                CompletionChoice(
                    index=index * n + choice.index,
                    text=prompt_text + choice.text,
                    logprobs=logprobs,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                    prompt_logprobs=vllm_prompt_logprobs(finals[index])
                    if body.prompt_logprobs is not None
                    else None,
                    prompt_token_ids=finals[index].prompt_token_ids if body.return_token_ids else None,
                    token_ids=choice.token_ids if body.return_token_ids else None,
                )
            )
    response = CompletionResponse(
        id=request_id,
        model=state.response_model(body.model),
        choices=choices,
        usage=usage_of(finals.values()),
    )
    return JSONResponse(response.model_dump(), headers=headers)


async def _stream(
    state: ServerState,
    request_id: str,
    body: CompletionRequest,
    prompt_texts: list[str],
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    options: StreamOptions,
) -> AsyncIterator[str]:
    tracker = StreamTracker()
    n = body.n or 1
    async for index, output in outputs:
        for delta in tracker.deltas(index, output):
            choice = delta.choice
            prefix = prompt_texts[index] if body.echo and delta.first else ""
            logprobs = None
            if body.logprobs is not None:
                shift = len(prompt_texts[index]) if body.echo else 0  # offsets count the echoed prompt
                logprobs = completion_logprobs(
                    choice.token_ids, choice.logprobs or [], shift + delta.text_offset
                )
                if prefix:
                    logprobs = join_logprobs(_prompt_logprobs(state, tracker.first_outputs[index]), logprobs)
            chunk = CompletionResponse(
                id=request_id,
                model=state.response_model(body.model),
                choices=[
                    CompletionChoice(
                        index=index * n + choice.index,
                        text=prefix + choice.text,
                        logprobs=logprobs,
                        finish_reason=choice.finish_reason,
                        stop_reason=choice.stop_reason,
                        prompt_token_ids=output.prompt_token_ids
                        if body.return_token_ids and delta.first
                        else None,
                        token_ids=choice.token_ids if body.return_token_ids else None,
                    )
                ],
                usage=tracker.usage() if options.include_usage and options.continuous_usage_stats else None,
            )
            yield sse(chunk)
    if options.include_usage:
        yield sse(
            CompletionResponse(
                id=request_id, model=state.response_model(body.model), choices=[], usage=tracker.usage()
            )
        )


def _prompt_logprobs(state: ServerState, output: RequestOutput):
    tokenizer = state.engine.engine.tokenizer
    ids = output.prompt_token_ids
    return echoed_prompt_logprobs(
        ids, output.prompt_logprobs or [None] * len(ids), [tokenizer.decode([t]) for t in ids]
    )
