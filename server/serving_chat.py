"""POST /v1/chat/completions: messages (and tools) through the chat template, whole or streamed; the reply's
reasoning and tool calls read out of its text (chat_message.py)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jpaged_server.chat_message import ChatReply, ReplyFormat, finish_reason
from jpaged_server.chat_template import ChatPrompt, chat_prompt_ids
from jpaged_server.errors import APIError
from jpaged_server.generation import EngineInput, final_output, generate_outputs, response_id
from jpaged_server.logprobs import chat_logprobs, vllm_prompt_logprobs
from jpaged_server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    DeltaMessage,
    StreamOptions,
)
from jpaged_server.reasoning_parsers import REASONING_PARSERS
from jpaged_server.sampling import check_for_engine, resolve_max_tokens, sampling_params, truncated_prompt
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


async def chat_engine_input(state: ServerState, body: ChatCompletionRequest) -> tuple[EngineInput, ChatReply]:
    if body.continue_final_message and body.add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true: set add_generation_prompt "
            "to false to continue the last message",
            "continue_final_message",
        )
    # gpt-oss speaks harmony (harmony.py, chosen by build_app); every other model has its chat template.
    chat = state.harmony.prompt(body) if state.harmony is not None else _template_prompt(state, body)
    engine = state.engine.engine
    ids = truncated_prompt(chat.ids, body.truncate_prompt_tokens, state.max_model_len)
    asked, param = body.max_tokens, "max_tokens"
    if body.max_completion_tokens is not None:  # OpenAI's newer name wins
        asked, param = body.max_completion_tokens, "max_completion_tokens"
    max_tokens = resolve_max_tokens(
        asked, None, len(ids), state.max_model_len, param=param, prompt_param="messages"
    )
    spec = None
    if chat.constraint is not None:
        spec, param = chat.constraint
        await check_compiles(state, spec, param)
    if chat.stop_token_ids:
        stops = [*(body.stop_token_ids or ()), *chat.stop_token_ids]
        body = body.model_copy(update={"stop_token_ids": stops})
    params = sampling_params(
        body, max_tokens=max_tokens, logprobs=_num_logprobs(body), structured_outputs=spec
    )
    check_for_engine(engine, ids, params, "messages")
    return EngineInput(ids, params), chat.reply


def _template_prompt(state: ServerState, body: ChatCompletionRequest) -> ChatPrompt:
    tools = plan_tools(body, auto_tool_parser=state.auto_tool_parser)
    # A forced tool call's grammar wins over response_format and structured_outputs, as in vLLM (the Agents SDK
    # sends its output_type's schema beside tool_choice="required"): the reply is the call.
    constraint = (tools.spec, "tools") if tools.spec is not None else requested_spec(body)
    template_kwargs = body.chat_template_kwargs
    if body.reasoning_effort is not None:  # for the templates of models that think
        template_kwargs = {"reasoning_effort": body.reasoning_effort, **(template_kwargs or {})}
    ids = chat_prompt_ids(
        state.engine.engine.tokenizer,
        body.messages,
        chat_template=state.chat_template,
        add_generation_prompt=body.add_generation_prompt,
        template_kwargs=template_kwargs,
        tools=tools.template_tools,
        continue_final_message=body.continue_final_message,
        add_special_tokens=body.add_special_tokens,
    )
    reasoning = REASONING_PARSERS[state.reasoning_parser] if state.reasoning_parser else None
    reply = ReplyFormat(reasoning, tools.format, body.include_reasoning, tools.legacy)
    return ChatPrompt(ids, reply, constraint)


def _echoed(body: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the reply starts with the last message's text when that message is the assistant's."""
    last = body.messages[-1]
    return last.text() if body.echo and last.role == "assistant" else ""


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = get_state(request)
    lora = state.check_model(body.model)
    headers = state.check_fields(body)
    engine_input, reply = await chat_engine_input(state, body)
    state.admit()
    request_id = response_id("chatcmpl", body.request_id, request)
    outputs = generate_outputs(
        state,
        request_id,
        [engine_input],
        request,
        priority=body.priority,
        cache_salt=body.cache_salt,
        lora_request=lora,
    )
    if body.stream:
        options = body.stream_options or StreamOptions()
        events = end_stream(
            outputs, _stream(state, request_id, body, engine_input.params.n, reply, outputs, options)
        )
        return StreamingResponse(events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
    return await _whole(state, request_id, body, reply, outputs, headers)


async def _whole(
    state: ServerState,
    request_id: str,
    body: ChatCompletionRequest,
    reply: ChatReply,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    headers: dict[str, str],
) -> Response:
    final = await final_output(outputs)
    echo = _echoed(body)
    choices = []
    for choice in sorted(final.outputs, key=lambda c: c.index):
        message = reply.message(choice.text, choice.token_ids)
        if echo:
            message.content = echo + (message.content or "")
        choices.append(
            ChatChoice(
                index=choice.index,
                message=message,
                logprobs=chat_logprobs(choice.token_ids, choice.logprobs or [], body.top_logprobs or 0)
                if body.logprobs
                else None,
                finish_reason=finish_reason(
                    choice.finish_reason,
                    bool(message.tool_calls or message.function_call),
                    reply.legacy_functions,
                ),
                stop_reason=choice.stop_reason,
                token_ids=choice.token_ids if body.return_token_ids else None,
            )
        )
    response = ChatCompletionResponse(
        id=request_id,
        model=state.response_model(body.model),
        choices=choices,
        usage=usage_of([final]),
        prompt_logprobs=vllm_prompt_logprobs(final) if body.prompt_logprobs is not None else None,
        prompt_token_ids=final.prompt_token_ids if body.return_token_ids else None,
    )
    return JSONResponse(response.model_dump(), headers=headers)


async def _stream(
    state: ServerState,
    request_id: str,
    body: ChatCompletionRequest,
    n: int,
    reply: ChatReply,
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    options: StreamOptions,
) -> AsyncIterator[str]:
    tracker = StreamTracker()

    def chunk(choice: ChatStreamChoice, **extra) -> str:
        usage = tracker.usage() if options.include_usage and options.continuous_usage_stats else None
        return sse(
            ChatCompletionChunk(
                id=request_id, model=state.response_model(body.model), choices=[choice], usage=usage, **extra
            )
        )

    replies = [reply.streaming() for _ in range(n)]
    echo = _echoed(body)
    opened = False
    async for _, output in outputs:
        for delta in tracker.deltas(0, output):
            if not opened:  # OpenAI opens every choice with the role, before any content
                opened = True
                for index in range(n):
                    ids = output.prompt_token_ids if body.return_token_ids and index == 0 else None
                    role = DeltaMessage(role="assistant", content=echo)
                    yield chunk(ChatStreamChoice(index=index, delta=role), prompt_token_ids=ids)
            choice = delta.choice
            streaming = replies[choice.index]
            message = streaming.feed(
                choice.text, final=choice.finish_reason is not None, token_ids=choice.token_ids
            )
            logprobs = None
            if body.logprobs and choice.token_ids:
                logprobs = chat_logprobs(choice.token_ids, choice.logprobs or [], body.top_logprobs or 0)
            token_ids = choice.token_ids if body.return_token_ids and choice.token_ids else None
            if message.is_empty() and logprobs is None and token_ids is None and choice.finish_reason is None:
                continue  # text a parser holds back (a tag's possible start): no empty delta
            yield chunk(
                ChatStreamChoice(
                    index=choice.index,
                    delta=message,
                    logprobs=logprobs,
                    finish_reason=finish_reason(
                        choice.finish_reason, streaming.called, reply.legacy_functions
                    ),
                    stop_reason=choice.stop_reason,
                    token_ids=token_ids,
                )
            )
    if options.include_usage:
        yield sse(
            ChatCompletionChunk(
                id=request_id, model=state.response_model(body.model), choices=[], usage=tracker.usage()
            )
        )
