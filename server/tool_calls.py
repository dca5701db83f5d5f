"""A chat request's tools: what the chat template sees, which grammar forces a call, how calls are read back.

`tool_choice`: "none" (tools shown to the template, the reply is text), "auto" (the model may call; the server's
--tool-call-parser reads its format; needs --enable-auto-tool-choice), "required" (the output is constrained to a
JSON array of one or more {"name", "parameters"} calls, one when parallel_tool_calls is false) or a named
function (the output is constrained to that function's parameters). The last two hold whatever the model, and
always answer with calls, even when max_tokens cut them short (finish_reason "length" says so).

The legacy `functions` / `function_call` fields are the same plan over tools, answered in their own shape
(`message.function_call`, finish_reason "function_call").
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from jpaged_server.errors import APIError
from jpaged_server.protocol import ChatCompletionRequest, ChatTool, NamedToolChoice
from jpaged_server.tool_parsers import (
    TOOL_PARSERS,
    Body,
    ParsedOutput,
    RequiredArrayFormat,
    ToolCall,
    ToolFormat,
    dump_arguments,
)

from jpaged.sampling_params import StructuredOutputsParams


@dataclass(frozen=True, slots=True)
class NamedFormat(ToolFormat):
    """A named tool_choice: the whole output is the arguments of that one function."""

    name: str

    def segments(self, text: str, final: bool) -> tuple[str, list[Body]]:
        return "", [Body(f'{{"name": {json.dumps(self.name)}, "arguments": {text}}}', final)]

    def parse(self, text: str) -> ParsedOutput:
        try:
            arguments = dump_arguments(json.loads(text))
        except json.JSONDecodeError:  # cut by max_tokens: the arguments as far as they came
            arguments = text
        return ParsedOutput(None, [ToolCall(self.name, arguments)])


@dataclass(frozen=True, slots=True)
class ToolPlan:
    template_tools: list[dict] | None  # for apply_chat_template(tools=...)
    spec: StructuredOutputsParams | None  # the grammar that forces the call(s)
    format: ToolFormat | None  # how calls are read out of the reply; None: the reply is text
    legacy: bool = False  # asked with `functions`: answered as `function_call`


NO_TOOLS = ToolPlan(None, None, None)


def plan_tools(body: ChatCompletionRequest, *, auto_tool_parser: str | None) -> ToolPlan:
    """The request's tools as a plan; 400s for a choice that cannot be served. `auto_tool_parser` is the
    server's --tool-call-parser when --enable-auto-tool-choice is on."""
    if body.functions is None and body.function_call is None:
        return _plan(body, auto_tool_parser)
    if body.tools is not None or body.tool_choice is not None:
        raise APIError(
            400,
            "give tools and tool_choice, or the legacy functions and function_call, not both",
            "functions",
        )
    choice = body.function_call
    as_tools = body.model_copy(
        update={
            "tools": [ChatTool(function=function) for function in body.functions or ()],
            "tool_choice": choice
            if isinstance(choice, str) or choice is None
            else NamedToolChoice(function=choice),
            "functions": None,
            "function_call": None,
        }
    )
    return dataclasses.replace(_plan(as_tools, auto_tool_parser, param="function_call"), legacy=True)


def _plan(body: ChatCompletionRequest, auto_tool_parser: str | None, param: str = "tool_choice") -> ToolPlan:
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, f"{param} needs tools", param)
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
                param,
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
        raise APIError(400, f"{param} names {name!r}, which is not among the tools", param)
    spec = StructuredOutputsParams(json=_parameters(by_name[name].parameters))
    return ToolPlan(template_tools, spec, NamedFormat(name))


def _parameters(parameters: dict | None) -> dict:
    return parameters if parameters else {"type": "object"}
