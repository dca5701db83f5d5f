"""The Responses API's request and response bodies, and the request's parts in the chat request's terms.

A Responses request is served as a chat request (serving_responses.py): its `input` items become chat messages,
its flat function tools chat tools, `text.format` a `response_format`. What it declares here is what the Responses
API has and chat has not; any other field (vLLM's sampling extras: top_k, min_p, repetition_penalty, stop, seed,
...) is kept aside and handed to the chat request, which accepts, ignores or refuses it as chat does.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from jpaged_server.errors import APIError
from jpaged_server.protocol import RequestModel
from pydantic import BaseModel, Field

# Responses fields that would change what is returned and are not served here: a 400 names them.
UNSUPPORTED_FIELDS = {
    "background": "background responses are not supported: send background false (or leave it out)",
    "conversation": "conversations are not supported: chain responses with previous_response_id",
    "prompt": "stored prompt templates are not supported: send the input itself",
}


class TextFormat(RequestModel):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # a hint for OpenAI's own models


class ReasoningConfig(RequestModel):
    effort: str | None = None  # handed to the chat template, as chat's reasoning_effort
    summary: str | None = None  # OpenAI's summaries: the reasoning is returned whole instead
    generate_summary: str | None = None


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    include: list[str] | None = None
    background: bool = False
    truncation: Literal["auto", "disabled"] | None = None  # nothing is truncated: a prompt too long is a 400
    metadata: dict[str, str] | None = None
    user: str | None = None
    top_logprobs: int | None = None  # logprobs come only with include (not supported)
    max_tool_calls: int | None = None

    def check_supported(self) -> None:
        for name, why in UNSUPPORTED_FIELDS.items():
            if (self.model_extra or {}).get(name) is not None:
                raise APIError(400, f"{name}: {why}", name)
        if self.background:
            raise APIError(400, f"background: {UNSUPPORTED_FIELDS['background']}", "background")
        for i, item in enumerate(self.include or ()):
            raise APIError(
                400, f"include: {item!r} is not supported (nothing extra can be included)", f"include[{i}]"
            )


# ---- the request in chat's terms ----


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses' flat function tools ({type, name, parameters, ...}) as chat's ({type, function: {...}})."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise APIError(
                400,
                f"tools[{i}]: {kind!r} tools are not supported; only function tools are",
                f"tools[{i}].type",
            )
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        400,
        f"tool_choice {choice!r} is not supported: give 'none', 'auto', 'required' or "
        "{'type': 'function', 'name': ...}",
        "tool_choice",
    )


def chat_response_format(fmt: TextFormat) -> dict[str, Any] | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise APIError(400, "text.format: a json_schema format needs its schema", "text.format.schema")
    json_schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": json_schema}


def chat_messages(items: str | list[dict[str, Any]], param: str = "input") -> list[dict[str, Any]]:
    """Input items (or earlier output items) as chat messages. An assistant's reasoning, text and function calls
    arrive as separate items; consecutive ones make one assistant message, as the chat template expects."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        at = f"{param}[{i}]"
        kind = item.get("type", "message")
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{at}.role: {role!r} is not a message role", f"{at}.role")
            text = _text(item.get("content"), f"{at}.content")
            if role == "assistant" and last is not None and last.get("content") is None:
                last["content"] = text
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", at),
                "type": "function",
                "function": {"name": _field(item, "name", at), "arguments": _field(item, "arguments", at)},
            }
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, f"{at}.output")
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", at), "content": content})
        elif kind == "reasoning":
            if item.get("encrypted_content"):
                raise APIError(400, f"{at}: encrypted reasoning is not supported", f"{at}.encrypted_content")
            parts = item.get("content") or item.get("summary") or []
            reasoning = _text(parts, f"{at}.content", kinds=("reasoning_text", "summary_text"))
            if last is not None and last.get("reasoning") is None and last.get("content") is None:
                last["reasoning"] = reasoning
            else:
                messages.append({"role": "assistant", "content": None, "reasoning": reasoning})
        else:
            raise APIError(400, f"{at}: {kind!r} input items are not supported", f"{at}.type")
    return messages


def _field(item: dict[str, Any], name: str, at: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError(400, f"{at}.{name}: a string is required", f"{at}.{name}")
    return value


def _text(content: Any, at: str, kinds: tuple[str, ...] = ("input_text", "output_text", "text")) -> str:
    """A message's content, a string or a list of text parts (input_text, output_text), as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{at}: a string or a list of text parts is required", at)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in kinds:
            texts.append(_field(part, "text", f"{at}[{j}]"))
        elif kind == "refusal":
            texts.append(_field(part, "refusal", f"{at}[{j}]"))
        else:
            raise APIError(
                400, f"{at}[{j}]: {kind!r} content is not supported; only text is", f"{at}[{j}].type"
            )
    return "\n".join(texts)


# ---- the response ----


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str = Field(default_factory=lambda: new_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    id: str = Field(default_factory=lambda: new_id("rs"))
    type: Literal["reasoning"] = "reasoning"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    id: str = Field(default_factory=lambda: new_id("fc"))
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    call_id: str
    name: str
    arguments: str = ""


OutputItem = OutputMessage | ReasoningItem | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    cache_write_tokens: int = 0  # OpenAI's explicit prompt caching: none here


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """OpenAI's Response; the request's settings echoed as it echoes them."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool = False

    @classmethod
    def of_request(cls, response_id: str, model: str, body: ResponsesRequest) -> ResponseObject:
        """The response to `body` before any output (status in_progress)."""
        text = (
            body.text.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else None
        )
        return cls(
            id=response_id,
            status="in_progress",
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            model=model,
            parallel_tool_calls=body.parallel_tool_calls,
            previous_response_id=body.previous_response_id,
            reasoning=body.reasoning.model_dump(exclude_none=True) if body.reasoning else None,
            store=body.store,
            temperature=body.temperature,
            **({"text": text} if text else {}),
            tool_choice=body.tool_choice or "auto",
            tools=body.tools or [],
            top_p=body.top_p,
            truncation=body.truncation or "disabled",
            user=body.user,
            metadata=body.metadata or {},
        )
