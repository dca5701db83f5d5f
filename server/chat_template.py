"""Chat messages to prompt token ids through the model's (or the server's --chat-template) Jinja template."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jpaged_server.errors import APIError
from jpaged_server.protocol import ChatMessage

from jpaged.engine.tokenizer import apply_chat_template

if TYPE_CHECKING:
    from jpaged_server.chat_message import ChatReply

    from jpaged.sampling_params import StructuredOutputsParams


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A chat request made ready for the engine: by the chat template (serving_chat) or by harmony (harmony.py)."""

    ids: list[int]
    reply: ChatReply  # how the reply is read back into OpenAI's message
    constraint: tuple[StructuredOutputsParams, str] | None = (
        None  # a grammar, and the field that asked for it
    )
    stop_token_ids: list[int] = field(default_factory=list)  # the format's own, beside the request's


def load_chat_template(value: str | None) -> str | None:
    """--chat-template is a file path or the template itself; a path that does not exist is an error."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{" not in value:
        raise ValueError(f"chat_template: {value!r} is neither a readable file nor a Jinja template")
    return value


def _reserved_kwargs(tokenizer) -> set[str]:
    """Names apply_chat_template takes itself: passing them as template variables would change its behaviour."""
    return {name for name in inspect.signature(tokenizer.apply_chat_template).parameters if name != "kwargs"}


def chat_prompt_ids(
    tokenizer,
    messages: list[ChatMessage],
    *,
    chat_template: str | None,
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None,
    tools: list[dict] | None = None,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
) -> list[int]:
    """The conversation's prompt ids. `continue_final_message`: the reply continues the last message (no end of
    turn after it); `add_special_tokens`: the tokenizer's own BOS too, for templates that do not write it."""
    template_kwargs = template_kwargs or {}
    reserved = sorted(_reserved_kwargs(tokenizer) & template_kwargs.keys())
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs")
    conversation = [_template_message(m) for m in messages]
    try:
        return apply_chat_template(
            tokenizer,
            conversation,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            add_special_tokens=add_special_tokens,
            **({"tools": tools} if tools else {}),
            **({"continue_final_message": True} if continue_final_message else {}),
            **template_kwargs,
        )
    except ValueError as err:  # no chat template, or one that refuses the conversation (role order, a role)
        raise APIError(400, str(err), "messages") from None


def _template_message(message: ChatMessage) -> dict:
    """A message as chat templates read it: earlier tool calls with their arguments as objects (templates
    render them with tojson), a tool reply with the id of the call it answers."""
    role = "tool" if message.role == "function" else message.role  # the legacy functions' reply is a tool's
    out: dict[str, Any] = {"role": role, "content": message.text()}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    calls = [(call.id, call.function) for call in message.tool_calls or ()]
    if message.function_call is not None:  # the legacy shape of one earlier call
        calls.append((None, message.function_call))
    if calls:
        out["tool_calls"] = [
            {
                **({"id": call_id} if call_id else {}),
                "type": "function",
                "function": {"name": function.name, "arguments": _arguments(function.arguments)},
            }
            for call_id, function in calls
        ]
    return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise APIError(400, f"a tool call's arguments are not JSON: {text!r}", "messages") from None
