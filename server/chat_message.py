"""A chat reply's text as OpenAI's message: the reasoning (--reasoning-parser) split off first, then the tool
calls read out of the rest (the request's ToolPlan); whole, or as deltas for a stream."""

from __future__ import annotations

from dataclasses import dataclass

from jpaged_server.protocol import (
    AssistantMessage,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    ToolCallOut,
)
from jpaged_server.reasoning_parsers import StreamingReasoningParser, ThinkFormat
from jpaged_server.tool_parsers import StreamingToolParser, ToolFormat


@dataclass(frozen=True, slots=True)
class ReplyFormat:
    reasoning: ThinkFormat | None
    tools: ToolFormat | None

    def message(self, text: str) -> AssistantMessage:
        reasoning, content = self.reasoning.parse(text) if self.reasoning else (None, text)
        calls = None
        if self.tools is not None:
            parsed = self.tools.parse(content)
            content, calls = parsed.content, parsed.tool_calls or None
        return AssistantMessage(
            content=content,
            reasoning=reasoning,
            reasoning_content=reasoning,
            tool_calls=[
                ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                for c in calls
            ]
            if calls
            else None,
        )


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI says "tool_calls" when a reply that called tools stopped by itself."""
    return "tool_calls" if called and reason == "stop" else reason


class StreamingReply:
    """One choice's deltas: reasoning, content and tool calls in OpenAI's delta shape."""

    def __init__(self, fmt: ReplyFormat) -> None:
        self._reasoning = StreamingReasoningParser(fmt.reasoning) if fmt.reasoning else None
        self._tools = StreamingToolParser(fmt.tools) if fmt.tools else None

    @property
    def called(self) -> bool:
        return self._tools is not None and self._tools.num_calls > 0

    def feed(self, text: str) -> DeltaMessage:
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        return self._delta(reasoning, content, final=False)

    def finish(self) -> DeltaMessage:
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        return self._delta(reasoning, content, final=True)

    def _delta(self, reasoning: str, content: str, final: bool) -> DeltaMessage:
        calls = []
        if self._tools is not None:
            new = self._tools.feed(content)
            if final:
                done = self._tools.finish()
                new.content += done.content
                new.tool_calls += done.tool_calls
            content = new.content
            calls = [
                DeltaToolCall(
                    index=c.index,
                    id=c.id,
                    type="function" if c.id else None,
                    function=FunctionCallOut(name=c.name, arguments=c.arguments),
                )
                for c in new.tool_calls
            ]
        return DeltaMessage(
            content=content or None,
            reasoning=reasoning or None,
            reasoning_content=reasoning or None,
            tool_calls=calls or None,
        )
