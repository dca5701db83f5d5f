"""POST /v1/chat/completions: messages through the chat template, whole or streamed."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jpaged_server.chat_template import chat_prompt_ids
from jpaged_server.errors import APIError
from jpaged_server.generation import EngineInput, GenerationStopped, generate_outputs
from jpaged_server.logprobs import chat_logprobs
from jpaged_server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    DeltaMessage,
)
from jpaged_server.sampling import check_for_engine, resolve_max_tokens, sampling_params
from jpaged_server.state import ServerState, get_state
from jpaged_server.streaming import SSE_HEADERS, StreamTracker, end_stream, sse, usage_of

from jpaged.outputs import RequestOutput
from jpaged.sampling_params import MAX_LOGPROBS


def _num_logprobs(body: ChatCompletionRequest) -> int | None:
    """Chat's (logprobs: bool, top_logprobs: int) as the engine's number of top logprobs (None: off)."""
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise APIError(
            400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}", "top_logprobs"
        )
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def _engine_input(state: ServerState, body: ChatCompletionRequest) -> EngineInput:
    engine = state.engine.engine
    ids = chat_prompt_ids(
        engine.tokenizer,
        body.messages,
        chat_template=state.chat_template,
        add_generation_prompt=body.add_generation_prompt,
        template_kwargs=body.chat_template_kwargs,
    )
    asked, param = body.max_tokens, "max_tokens"
    if body.max_completion_tokens is not None:  # OpenAI's newer name wins
        asked, param = body.max_completion_tokens, "max_completion_tokens"
    max_tokens = resolve_max_tokens(
        asked, None, len(ids), state.max_model_len, param=param, prompt_param="messages"
    )
    params = sampling_params(body, max_tokens=max_tokens, logprobs=_num_logprobs(body))
    check_for_engine(engine, ids, params, "messages")
    return EngineInput(ids, params)


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = get_state(request)
    state.check_model(body.model)
    engine_input = _engine_input(state, body)
    state.admit()
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    outputs = generate_outputs(
        state, request_id, [engine_input], request, priority=body.priority, cache_salt=body.cache_salt
    )
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = end_stream(
            outputs, _stream(state, request_id, body, engine_input.params.n, outputs, include_usage)
        )
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    return await _whole(state, request_id, body, outputs)


async def _whole(
    state: ServerState,
    request_id: str,
    body: ChatCompletionRequest,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
) -> Response:
    final = None
    try:
        async for _, output in outputs:
            final = output
    except GenerationStopped as stopped:
        raise APIError(503, str(stopped)) from None
    assert final is not None and final.finished
    choices = [
        ChatChoice(
            index=choice.index,
            message=AssistantMessage(content=choice.text),
            logprobs=chat_logprobs(choice.token_ids, choice.logprobs or [], body.top_logprobs or 0)
            if body.logprobs
            else None,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
        )
        for choice in sorted(final.outputs, key=lambda c: c.index)
    ]
    response = ChatCompletionResponse(
        id=request_id, model=state.model_name, choices=choices, usage=usage_of([final])
    )
    return JSONResponse(response.model_dump())


async def _stream(
    state: ServerState,
    request_id: str,
    body: ChatCompletionRequest,
    n: int,
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    include_usage: bool,
) -> AsyncIterator[str]:
    def chunk(choice: ChatStreamChoice) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=state.model_name, choices=[choice]))

    tracker = StreamTracker()
    for index in range(n):  # OpenAI opens every choice with the role, before any content
        yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
    async for _, output in outputs:
        for delta in tracker.deltas(0, output):
            choice = delta.choice
            logprobs = None
            if body.logprobs:
                logprobs = chat_logprobs(choice.token_ids, choice.logprobs or [], body.top_logprobs or 0)
            yield chunk(
                ChatStreamChoice(
                    index=choice.index,
                    delta=DeltaMessage(content=choice.text) if choice.text else DeltaMessage(),
                    logprobs=logprobs,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
            )
    if include_usage:
        usage = tracker.usage()
        yield sse(ChatCompletionChunk(id=request_id, model=state.model_name, choices=[], usage=usage))
