"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it), GET and DELETE /v1/responses/{id}.

A Responses request is served as a chat request: its input (after the stored conversation it continues, with
`previous_response_id`) becomes chat messages, and serving_chat.chat_engine_input does the rest (template, tools,
structured output, sampling). The reply's reasoning, text and function calls become output items, whole or as
OpenAI's event stream: response.created, response.in_progress, then per item output_item.added, its content part
or arguments as deltas, their .done events and output_item.done, and response.completed. A finished response is
kept in the app's ResponseStore (response_store.py) unless `store` is false.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jpaged_server.chat_message import ChatReply
from jpaged_server.errors import APIError, describe_validation_error
from jpaged_server.generation import GenerationStopped, final_output, generate_outputs
from jpaged_server.protocol import AssistantMessage, ChatCompletionRequest, DeltaMessage, DeltaToolCall
from jpaged_server.request_fields import IGNORED_FIELDS_HEADER
from jpaged_server.response_store import ResponseStore, StoredResponse
from jpaged_server.responses_protocol import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    chat_messages,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    new_id,
)
from jpaged_server.serving_chat import chat_engine_input
from jpaged_server.state import ServerState, get_state
from jpaged_server.streaming import SSE_HEADERS, StreamTracker, sse_error, usage_of
from pydantic import ValidationError

from jpaged.outputs import RequestOutput

# Chat fields a Responses request sets from its own: the same names sent to /v1/responses are not chat's to read.
OWN_CHAT_FIELDS = frozenset(
    {
        "messages",
        "tools",
        "tool_choice",
        "response_format",
        "max_tokens",
        "max_completion_tokens",
        "reasoning_effort",
        "n",
        "functions",
        "function_call",
        "stream",
        "stream_options",
        "logprobs",
        "echo",
    }
)
# A refusal on the chat side names chat's field; the client sent the Responses one.
RESPONSES_NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}


def get_store(request: Request) -> ResponseStore:
    return request.app.state.responses


async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state = get_state(request)
    store = get_store(request)
    lora = state.check_model(body.model)
    body.check_supported()
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise APIError(
                404,
                f"no stored response has the id {body.previous_response_id!r} (never stored, deleted, or "
                f"forgotten: the server keeps the last {store.max_size})",
                "previous_response_id",
            )
        history = previous.messages + chat_messages(previous.response["output"], "previous_response_id")
    conversation = history + chat_messages(body.input)
    chat = _chat_request(body, conversation)
    headers = state.check_fields(chat)
    dropped = [name for name in body.model_extra or {} if name in OWN_CHAT_FIELDS]
    if dropped:
        headers[IGNORED_FIELDS_HEADER] = ", ".join(
            filter(None, [headers.get(IGNORED_FIELDS_HEADER), *dropped])
        )
    try:
        engine_input, reply = await chat_engine_input(state, chat)
    except APIError as err:
        raise _in_responses_terms(err) from None
    state.admit()
    response = ResponseObject.of_request(new_id("resp"), state.response_model(body.model), body)
    outputs = generate_outputs(
        state,
        response.id,
        [engine_input],
        request,
        priority=chat.priority,
        cache_salt=chat.cache_salt,
        lora_request=lora,
    )
    finished = _Finisher(state, store if body.store else None, response, conversation)
    if body.stream:
        events = _stream(response, reply, outputs, finished)
        return StreamingResponse(events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
    final = await final_output(outputs)
    choice = final.outputs[0]
    done = finished(
        _output_items(reply.message(choice.text, choice.token_ids)), choice.finish_reason, usage_of([final])
    )
    return JSONResponse(done.model_dump(), headers=headers)


async def retrieve_response(response_id: str, request: Request) -> JSONResponse:
    stored = get_store(request).get(response_id)
    if stored is None:
        raise APIError(404, f"no stored response has the id {response_id!r}", "response_id")
    return JSONResponse(stored.response)


async def delete_response(response_id: str, request: Request) -> JSONResponse:
    if not get_store(request).delete(response_id):
        raise APIError(404, f"no stored response has the id {response_id!r}", "response_id")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _chat_request(body: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that serves `body`; the fields it did not declare (vLLM's sampling extras) go along."""
    fields = {name: value for name, value in (body.model_extra or {}).items() if name not in OWN_CHAT_FIELDS}
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields |= {
        "model": body.model,
        "messages": instructions + conversation,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_completion_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls,
        "tools": chat_tools(body.tools) if body.tools else None,
        "tool_choice": chat_tool_choice(body.tool_choice) if body.tool_choice is not None else None,
        "response_format": chat_response_format(body.text.format) if body.text and body.text.format else None,
        "reasoning_effort": body.reasoning.effort if body.reasoning else None,
    }
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as err:
        message, param = describe_validation_error(RequestValidationError(err.errors()))
        raise _in_responses_terms(APIError(400, message, param)) from None


def _in_responses_terms(err: APIError) -> APIError:
    """A chat refusal naming the Responses field instead (the whole `input` for a message, whose index in the
    chat messages is not the item's)."""
    param, message = err.param, err.message
    for chat_name, name in RESPONSES_NAMES.items():
        if chat_name != "messages":  # "messages" is also a plain word in messages
            message = message.replace(chat_name, name)
        if param is not None and (param == chat_name or param.startswith((f"{chat_name}.", f"{chat_name}["))):
            param = name if chat_name == "messages" else name + param[len(chat_name) :]
    return APIError(err.status, message, param, err.headers)


def _output_items(message: AssistantMessage) -> list[OutputItem]:
    items: list[OutputItem] = []
    if message.reasoning:
        items.append(ReasoningItem(content=[ReasoningText(text=message.reasoning)]))
    if message.content:
        items.append(OutputMessage(content=[OutputText(text=message.content)]))
    for call in message.tool_calls or ():
        items.append(
            FunctionCallItem(
                call_id=call.id, name=call.function.name or "", arguments=call.function.arguments or ""
            )
        )
    return items


class _Finisher:
    """The finished response from its output items, finish reason and token counts; stored when asked."""

    def __init__(
        self,
        state: ServerState,
        store: ResponseStore | None,
        response: ResponseObject,
        conversation: list[dict[str, Any]],
    ) -> None:
        self.tokenizer = state.engine.engine.tokenizer
        self.store = store
        self.response = response
        self.conversation = conversation

    def __call__(self, items: list[OutputItem], finish_reason: str | None, usage) -> ResponseObject:
        incomplete = finish_reason == "length"
        if incomplete:
            for item in items:
                if isinstance(item, OutputMessage):
                    item.status = "incomplete"
        reasoning = "".join(c.text for item in items if isinstance(item, ReasoningItem) for c in item.content)
        # The reply's tokens are not split by the parser; the reasoning's own tokenization counts them.
        reasoning_tokens = len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        response = self.response.model_copy(
            update={
                "status": "incomplete" if incomplete else "completed",
                "incomplete_details": IncompleteDetails(reason="max_output_tokens") if incomplete else None,
                "output": items,
                "usage": ResponseUsage(
                    input_tokens=usage.prompt_tokens,
                    output_tokens=usage.completion_tokens,
                    total_tokens=usage.total_tokens,
                    input_tokens_details=InputTokensDetails(
                        cached_tokens=usage.prompt_tokens_details.cached_tokens
                    ),
                    output_tokens_details=OutputTokensDetails(
                        reasoning_tokens=min(reasoning_tokens, usage.completion_tokens)
                    ),
                ),
            }
        )
        if self.store is not None:
            self.store.put(response.id, StoredResponse(response.model_dump(), self.conversation))
        return response


class _EventStream:
    """OpenAI's stream events for one reply, from its chat deltas: each event an SSE `event:`/`data:` pair with
    the next sequence_number; one output item open at a time (reasoning, message, or one function call)."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None
        self._call_index: int | None = None

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def feed(self, delta: DeltaMessage) -> list[str]:
        events = []
        if delta.reasoning:
            events += self._reasoning(delta.reasoning)
        if delta.content:
            events += self._text(delta.content)
        for call in delta.tool_calls or ():
            events += self._call(call)
        return events

    def _add(self, item: OutputItem) -> list[str]:
        events = self.close()
        self._open = item
        self.items.append(item)
        return [
            *events,
            self.event("response.output_item.added", output_index=self._index, item=item.model_dump()),
        ]

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._open.id, "output_index": self._index}

    def _reasoning(self, text: str) -> list[str]:
        events = []
        if not isinstance(self._open, ReasoningItem):
            events = self._add(ReasoningItem(status="in_progress"))
            self._open.content.append(ReasoningText(text=""))
            part = {"type": "reasoning_text", "text": ""}
            events.append(
                self.event("response.content_part.added", **self._where(), content_index=0, part=part)
            )
        self._open.content[0].text += text
        return [
            *events,
            self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text),
        ]

    def _text(self, text: str) -> list[str]:
        events = []
        if not isinstance(self._open, OutputMessage):
            events = self._add(OutputMessage(status="in_progress"))
            self._open.content.append(OutputText(text=""))
            part = OutputText(text="").model_dump()
            events.append(
                self.event("response.content_part.added", **self._where(), content_index=0, part=part)
            )
        self._open.content[0].text += text
        delta = self.event(
            "response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[]
        )
        return [*events, delta]

    def _call(self, call: DeltaToolCall) -> list[str]:
        events = []
        if not isinstance(self._open, FunctionCallItem) or self._call_index != call.index:
            name = call.function.name or ""
            events = self._add(
                FunctionCallItem(call_id=call.id or new_id("call"), name=name, status="in_progress")
            )
            self._call_index = call.index
        arguments = call.function.arguments
        if arguments:
            self._open.arguments += arguments
            events.append(
                self.event("response.function_call_arguments.delta", **self._where(), delta=arguments)
            )
        return events

    def close(self, status: str = "completed") -> list[str]:
        """The .done events of the open item, if any."""
        item, self._open, self._call_index = self._open, None, None
        if item is None:
            return []
        where = {"item_id": item.id, "output_index": self.items.index(item)}
        events = []
        if isinstance(item, FunctionCallItem):
            events.append(
                self.event(
                    "response.function_call_arguments.done", **where, name=item.name, arguments=item.arguments
                )
            )
        else:
            text = item.content[0].text
            if isinstance(item, ReasoningItem):
                events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
            else:
                events.append(
                    self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
                )
            part = item.content[0].model_dump()
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        item.status = status if isinstance(item, OutputMessage) else "completed"
        events.append(
            self.event(
                "response.output_item.done", output_index=where["output_index"], item=item.model_dump()
            )
        )
        return events


async def _stream(
    response: ResponseObject,
    reply: ChatReply,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    finished: _Finisher,
) -> AsyncIterator[str]:
    """The events of a streamed response. A generation stopped or failed mid-stream ends with one error event
    (nothing more when the client is gone); the engine request is closed whatever happens."""
    stream = _EventStream()
    try:
        yield stream.event("response.created", response=response.model_dump())
        yield stream.event("response.in_progress", response=response.model_dump())
        tracker, streaming, finish_reason = StreamTracker(), reply.streaming(), None
        async for _, output in outputs:
            for delta in tracker.deltas(0, output):
                choice = delta.choice
                final = choice.finish_reason is not None
                for event in stream.feed(streaming.feed(choice.text, final, choice.token_ids)):
                    yield event
                finish_reason = choice.finish_reason or finish_reason
        incomplete = finish_reason == "length"
        for event in stream.close("incomplete" if incomplete else "completed"):
            yield event
        done = finished(stream.items, finish_reason, tracker.usage())
        yield stream.event("response.completed", response=done.model_dump())
    except GenerationStopped as stopped:
        if not stopped.client_gone:
            yield sse_error(503, str(stopped))
    except APIError as err:
        yield sse_error(err.status, err.message)
    finally:
        await outputs.aclose()
