"""A chat reply's text as OpenAI's message: the reasoning (--reasoning-parser) split off first, then the tool
calls read out of the rest (the request's ToolPlan); whole, or as deltas for a stream."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from jpaged_server.protocol import (
    AssistantMessage,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)
from jpaged_server.reasoning_parsers import StreamingReasoningParser, ThinkFormat
from jpaged_server.tool_parsers import StreamingToolParser, ToolFormat


class StreamingChatReply(Protocol):
    called: bool  # a tool was called so far

    def feed(self, text: str, final: bool = False, token_ids: Iterable[int] = ()) -> DeltaMessage: ...


class ChatReply(Protocol):
    """A reply read back, whole or streamed: ReplyFormat (from its text) or harmony.HarmonyReply (its tokens)."""

    include_reasoning: bool
    legacy_functions: bool

    def message(self, text: str, token_ids: Iterable[int] = ()) -> AssistantMessage: ...

    def streaming(self) -> StreamingChatReply: ...


@dataclass(frozen=True, slots=True)
class ReplyFormat:
    reasoning: ThinkFormat | None
    tools: ToolFormat | None
    include_reasoning: bool = True  # False: the reasoning is split off and dropped
    legacy_functions: bool = False  # a call answers as `function_call` (the request gave `functions`)

    def streaming(self) -> StreamingReply:
        return StreamingReply(self)

    def message(self, text: str, token_ids: Iterable[int] = ()) -> AssistantMessage:
        reasoning, content = self.reasoning.parse(text) if self.reasoning else (None, text)
        reasoning = reasoning if self.include_reasoning else None
        calls = []
        if self.tools is not None:
            parsed = self.tools.parse(content)
            content, calls = parsed.content, parsed.tool_calls
        outs = [FunctionCallOut(name=c.name, arguments=c.arguments) for c in calls]
        if self.legacy_functions:
            return AssistantMessage(
                content=content,
                reasoning=reasoning,
                reasoning_content=reasoning,
                function_call=next(iter(outs), None),
            )
        return AssistantMessage(
            content=content,
            reasoning=reasoning,
            reasoning_content=reasoning,
            tool_calls=[ToolCallOut(id=c.id, function=out) for c, out in zip(calls, outs, strict=True)]
            or None,
        )


def finish_reason(reason: str | None, called: bool, legacy_functions: bool = False) -> str | None:
    """OpenAI says "tool_calls" ("function_call" for the legacy functions) when a reply that called tools stopped
    by itself."""
    if not (called and reason == "stop"):
        return reason
    return "function_call" if legacy_functions else "tool_calls"


class StreamingReply:
    """One choice's deltas: reasoning, content and tool calls in OpenAI's delta shape."""

    def __init__(self, fmt: ReplyFormat) -> None:
        self.format = fmt
        self._reasoning = StreamingReasoningParser(fmt.reasoning) if fmt.reasoning else None
        self._tools = StreamingToolParser(fmt.tools) if fmt.tools else None

    @property
    def called(self) -> bool:
        return self._tools is not None and self._tools.num_calls > 0

    def feed(self, text: str, final: bool = False, token_ids: Iterable[int] = ()) -> DeltaMessage:
        """The delta for the reply's next `text` (its `token_ids` are not read); `final` once the reply is done,
        with all that the parsers held back (a tag's possible start) until then."""
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        if final and self._reasoning:
            more_reasoning, more_content = self._reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        if not self.format.include_reasoning:
            reasoning = ""
        calls = []
        if self._tools is not None:
            new = self._tools.feed(content)
            if final:
                new.add(self._tools.finish())
            content, calls = new.content, new.tool_calls
        delta = DeltaMessage(
            content=content or None, reasoning=reasoning or None, reasoning_content=reasoning or None
        )
        if self.format.legacy_functions:
            first = next((c for c in calls if c.index == 0), None)
            if first is not None:
                delta.function_call = FunctionCallOut(name=first.name, arguments=first.arguments)
        elif calls:
            delta.tool_calls = [
                DeltaToolCall(
                    index=c.index,
                    id=c.id,
                    type="function" if c.id else None,
                    function=FunctionCallOut(name=c.name, arguments=c.arguments),
                )
                for c in calls
            ]
        return delta

    def finish(self) -> DeltaMessage:
        """What the parsers held back until the reply was done."""
        return self.feed("", final=True)
