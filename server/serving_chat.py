"""POST /v1/chat/completions: messages (and tools) through the chat template, whole or streamed; the reply's
reasoning and tool calls read out of its text (chat_message.py)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jpaged_server.chat_message import ReplyFormat, StreamingReply, finish_reason
from jpaged_server.chat_template import chat_prompt_ids
from jpaged_server.errors import APIError
from jpaged_server.generation import EngineInput, GenerationStopped, generate_outputs
from jpaged_server.logprobs import chat_logprobs
from jpaged_server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    DeltaMessage,
)
from jpaged_server.reasoning_parsers import REASONING_PARSERS
from jpaged_server.sampling import check_for_engine, resolve_max_tokens, sampling_params
from jpaged_server.state import ServerState, get_state
from jpaged_server.streaming import SSE_HEADERS, StreamTracker, end_stream, sse, usage_of
from jpaged_server.structured_request import check_compiles, requested_spec
from jpaged_server.tool_calls import plan_tools

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


async def chat_engine_input(
    state: ServerState, body: ChatCompletionRequest
) -> tuple[EngineInput, ReplyFormat]:
    engine = state.engine.engine
    tools = plan_tools(body, auto_tool_parser=state.auto_tool_parser)
    constraint = requested_spec(body)
    if tools.spec is not None:
        if constraint is not None:
            raise APIError(
                400, f"{constraint[1]} cannot be combined with a forced tool_choice", constraint[1]
            )
        constraint = tools.spec, "tools"
    ids = chat_prompt_ids(
        engine.tokenizer,
        body.messages,
        chat_template=state.chat_template,
        add_generation_prompt=body.add_generation_prompt,
        template_kwargs=body.chat_template_kwargs,
        tools=tools.template_tools,
    )
    asked, param = body.max_tokens, "max_tokens"
    if body.max_completion_tokens is not None:  # OpenAI's newer name wins
        asked, param = body.max_completion_tokens, "max_completion_tokens"
    max_tokens = resolve_max_tokens(
        asked, None, len(ids), state.max_model_len, param=param, prompt_param="messages"
    )
    spec = None
    if constraint is not None:
        spec, param = constraint
        await check_compiles(state, spec, param)
    params = sampling_params(
        body, max_tokens=max_tokens, logprobs=_num_logprobs(body), structured_outputs=spec
    )
    check_for_engine(engine, ids, params, "messages")
    reasoning = REASONING_PARSERS[state.reasoning_parser] if state.reasoning_parser else None
    return EngineInput(ids, params), ReplyFormat(reasoning, tools.format)


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = get_state(request)
    state.check_model(body.model)
    engine_input, reply = await chat_engine_input(state, body)
    state.admit()
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    outputs = generate_outputs(
        state, request_id, [engine_input], request, priority=body.priority, cache_salt=body.cache_salt
    )
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = end_stream(
            outputs, _stream(state, request_id, body, engine_input.params.n, reply, outputs, include_usage)
        )
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    return await _whole(state, request_id, body, reply, outputs)


async def _whole(
    state: ServerState,
    request_id: str,
    body: ChatCompletionRequest,
    reply: ReplyFormat,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
) -> Response:
    final = None
    try:
        async for _, output in outputs:
            final = output
    except GenerationStopped as stopped:
        raise APIError(503, str(stopped)) from None
    assert final is not None and final.finished
    choices = []
    for choice in sorted(final.outputs, key=lambda c: c.index):
        message = reply.message(choice.text)
        choices.append(
            ChatChoice(
                index=choice.index,
                message=message,
                logprobs=chat_logprobs(choice.token_ids, choice.logprobs or [], body.top_logprobs or 0)
                if body.logprobs
                else None,
                finish_reason=finish_reason(choice.finish_reason, bool(message.tool_calls)),
                stop_reason=choice.stop_reason,
            )
        )
    response = ChatCompletionResponse(
        id=request_id, model=state.model_name, choices=choices, usage=usage_of([final])
    )
    return JSONResponse(response.model_dump())


async def _stream(
    state: ServerState,
    request_id: str,
    body: ChatCompletionRequest,
    n: int,
    reply: ReplyFormat,
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    include_usage: bool,
) -> AsyncIterator[str]:
    def chunk(choice: ChatStreamChoice) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=state.model_name, choices=[choice]))

    tracker = StreamTracker()
    replies = [StreamingReply(reply) for _ in range(n)]
    for index in range(n):  # OpenAI opens every choice with the role, before any content
        yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
    async for _, output in outputs:
        for delta in tracker.deltas(0, output):
            choice = delta.choice
            logprobs = None
            if body.logprobs:
                logprobs = chat_logprobs(choice.token_ids, choice.logprobs or [], body.top_logprobs or 0)
            streaming = replies[choice.index]
            delta = streaming.feed(choice.text) if choice.text else DeltaMessage()
            if choice.finish_reason is not None:
                delta = _merged(delta, streaming.finish())
            yield chunk(
                ChatStreamChoice(
                    index=choice.index,
                    delta=delta,
                    logprobs=logprobs,
                    finish_reason=finish_reason(choice.finish_reason, streaming.called),
                    stop_reason=choice.stop_reason,
                )
            )
    if include_usage:
        usage = tracker.usage()
        yield sse(ChatCompletionChunk(id=request_id, model=state.model_name, choices=[], usage=usage))


def _merged(first: DeltaMessage, second: DeltaMessage) -> DeltaMessage:
    """One delta from two in a row (the last text's and what the parsers held back until the end)."""

    def join(a: str | None, b: str | None) -> str | None:
        return (a or "") + (b or "") or None

    return DeltaMessage(
        content=join(first.content, second.content),
        reasoning=join(first.reasoning, second.reasoning),
        reasoning_content=join(first.reasoning_content, second.reasoning_content),
        tool_calls=(first.tool_calls or []) + (second.tool_calls or []) or None,
    )
