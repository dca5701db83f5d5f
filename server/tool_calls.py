"""A chat request's tools: what the chat template sees, which grammar forces a call, how calls are read back.

`tool_choice`: "none" (tools shown to the template, the reply is text), "auto" (the model may call; the server's
--tool-call-parser reads its format; needs --enable-auto-tool-choice), "required" (the output is constrained to a
JSON array of one or more {"name", "parameters"} calls, one when parallel_tool_calls is false) or a named
function (the output is constrained to that function's parameters). The last two hold whatever the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from jpaged_server.errors import APIError
from jpaged_server.protocol import ChatCompletionRequest
from jpaged_server.tool_parsers import TOOL_PARSERS, Body, RequiredArrayFormat, ToolFormat

from jpaged.sampling_params import StructuredOutputsParams


@dataclass(frozen=True, slots=True)
class NamedFormat(ToolFormat):
    """A named tool_choice: the whole output is the arguments of that one function."""

    name: str

    def segments(self, text: str, final: bool) -> tuple[str, list[Body]]:
        return "", [Body(f'{{"name": {json.dumps(self.name)}, "arguments": {text}}}', final)]


@dataclass(frozen=True, slots=True)
class ToolPlan:
    template_tools: list[dict] | None  # for apply_chat_template(tools=...)
    spec: StructuredOutputsParams | None  # the grammar that forces the call(s)
    format: ToolFormat | None  # how calls are read out of the reply; None: the reply is text


NO_TOOLS = ToolPlan(None, None, None)


def plan_tools(body: ChatCompletionRequest, *, auto_tool_parser: str | None) -> ToolPlan:
    """The request's tools as a plan; 400s for a choice that cannot be served. `auto_tool_parser` is the
    server's --tool-call-parser when --enable-auto-tool-choice is on."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return NO_TOOLS
    template_tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    by_name = {tool.function.name: tool.function for tool in body.tools}
    choice = choice or "auto"
    if choice == "none":
        return ToolPlan(template_tools, None, None)
    if choice == "auto":
        if auto_tool_parser is None:
            raise APIError(
                400,
                '"auto" tool choice (the default when tools are given) needs the server started with '
                "--enable-auto-tool-choice and --tool-call-parser",
                "tool_choice",
            )
        return ToolPlan(template_tools, None, TOOL_PARSERS[auto_tool_parser]())
    if choice == "required":
        calls = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"enum": [name]}, "parameters": _parameters(function.parameters)},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for name, function in by_name.items()
            ]
        }
        schema = {"type": "array", "items": calls, "minItems": 1}
        if not body.parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolPlan(template_tools, StructuredOutputsParams(json=schema), RequiredArrayFormat())
    name = choice.function.name
    if name not in by_name:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    spec = StructuredOutputsParams(json=_parameters(by_name[name].parameters))
    return ToolPlan(template_tools, spec, NamedFormat(name))


def _parameters(parameters: dict | None) -> dict:
    return parameters if parameters else {"type": "object"}
