"""Chat messages to prompt token ids through the model's (or the server's --chat-template) Jinja template."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import jinja2
from jpaged_server.errors import APIError
from jpaged_server.protocol import ChatMessage

from jpaged.engine.tokenizer import apply_chat_template


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
) -> list[int]:
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
            **({"tools": tools} if tools else {}),
            **template_kwargs,
        )
    except (
        jinja2.TemplateError
    ) as err:  # templates raise on conversations they do not accept (role order, ...)
        raise APIError(400, f"the chat template rejected the messages: {err}", "messages") from None
    except ValueError as err:  # no chat template at all
        raise APIError(400, str(err), "messages") from None


def _template_message(message: ChatMessage) -> dict:
    """A message as chat templates read it: earlier tool calls with their arguments as objects (templates
    render them with tojson), a tool reply with the id of the call it answers."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise APIError(400, f"a tool call's arguments are not JSON: {text!r}", "messages") from None
