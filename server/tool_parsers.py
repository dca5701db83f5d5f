"""Tool calls out of a model's text, whole or streamed: hermes-style `<tool_call>{json}</tool_call>` (Qwen2.5,
Qwen3), Llama 3.1's bare JSON (`{"name": ..., "parameters": ...}`, `;`-separated, maybe after `<|python_tag|>`),
and the JSON array that `tool_choice="required"` constrains the output to.

Each format only says where the calls are in the text so far (`segments`); the streaming side re-reads the whole
text at every delta and sends what grew, so a tag or a JSON token split across deltas at any point cannot
confuse it. A call's arguments are sent as json.dumps of its arguments object, the whole as the streamed pieces
concatenated; partial JSON is read with partial-json-parser.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

import partial_json_parser
from partial_json_parser import Allow

# Partial numbers are left out (12 may become 123 or 1e5); partial strings are read (a long argument streams).
_PARTIAL_ARGUMENTS = Allow.ALL & ~Allow.NUM
_COMPLETE_STRINGS_ONLY = Allow.ALL & ~Allow.STR  # a name is known once its string is closed


@dataclass(slots=True)
class Body:
    """One call's JSON text, and whether the format has seen its end."""

    text: str
    complete: bool


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: new_call_id())


@dataclass(slots=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


@dataclass(slots=True)
class ToolCallDelta:
    index: int
    arguments: str
    id: str | None = None  # with the name, in the call's first delta only
    name: str | None = None


@dataclass(slots=True)
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, later: StreamDelta) -> None:
        """`later` appended, a call's pieces joined: a delta carries one entry a call index, as OpenAI's."""
        self.content += later.content
        for call in later.tool_calls:
            mine = next((c for c in self.tool_calls if c.index == call.index), None)
            if mine is None:
                self.tool_calls.append(call)
            else:
                mine.arguments += call.arguments
                mine.id, mine.name = mine.id or call.id, mine.name or call.name


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def held_back(text: str, tag: str) -> int:
    """Characters at the end of `text` that could be the start of `tag`: not sent until the next delta says."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def json_sequence(text: str, separators: str) -> list[Body]:
    """Consecutive JSON values (objects) separated by whitespace and `separators`; the last may be unfinished."""
    decoder = json.JSONDecoder()
    bodies, pos = [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos >= len(text):
            return bodies
        try:
            _, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return [*bodies, Body(text[pos:], False)]
        bodies.append(Body(text[pos:end], True))
        pos = end


class ToolFormat:
    """Where the calls are in a model's text; subclasses know one family's format."""

    arguments_keys: tuple[str, ...] = ("arguments",)

    def segments(self, text: str, final: bool) -> tuple[str, list[Body]]:
        """The text outside calls that is safe to send, and the calls' bodies so far."""
        raise NotImplementedError

    def arguments_of(self, call: dict):
        return next((call[key] for key in self.arguments_keys if key in call), {})

    def parse(self, text: str) -> ParsedOutput:
        """A finished output: its calls, or no calls and the whole text as content if any call is not JSON."""
        content, bodies = self.segments(text, final=True)
        calls = []
        for body in bodies:
            call = _json_object(body.text)
            if call is None:
                return ParsedOutput(text, [])
            calls.append(ToolCall(call["name"], dump_arguments(self.arguments_of(call))))
        return ParsedOutput(content.strip() or None, calls)


def _json_object(text: str, allow: Allow | None = None) -> dict | None:
    """`text` as a call object with a string name; None when it is not one. With `allow`, partial JSON is read."""
    try:
        call = json.loads(text) if allow is None else partial_json_parser.loads(text, allow)
    except Exception:  # json's errors, and partial-json-parser's own (and IndexError) on text it cannot read
        return None
    return call if isinstance(call, dict) and isinstance(call.get("name"), str) else None


class HermesFormat(ToolFormat):
    START, END = "<tool_call>", "</tool_call>"

    def segments(self, text: str, final: bool) -> tuple[str, list[Body]]:
        content, bodies, pos = [], [], 0
        while True:
            start = text.find(self.START, pos)
            if start < 0:
                tail = text[pos:]
                content.append(tail if final else tail[: len(tail) - held_back(tail, self.START)])
                return "".join(content), bodies
            content.append(text[pos:start])
            end = text.find(self.END, start)
            if end < 0:
                body = text[start + len(self.START) :]
                body = body if final else body[: len(body) - held_back(body, self.END)]
                return "".join(content), [*bodies, Body(body, False)]
            bodies.append(Body(text[start + len(self.START) : end], True))
            pos = end + len(self.END)


class Llama3JsonFormat(ToolFormat):
    """A reply that is (after an optional <|python_tag|>) JSON calls; any other reply is all content."""

    PYTHON_TAG = "<|python_tag|>"
    arguments_keys = ("parameters", "arguments")

    def segments(self, text: str, final: bool) -> tuple[str, list[Body]]:
        rest = text.lstrip()
        tagged = rest.startswith(self.PYTHON_TAG)
        if tagged:
            rest = rest[len(self.PYTHON_TAG) :].lstrip()
        if not final and (not rest or (not tagged and self.PYTHON_TAG.startswith(rest))):
            return "", []  # not yet known whether this is a call
        if not rest.startswith("{"):
            return text, []
        return "", json_sequence(rest, ";")


class RequiredArrayFormat(ToolFormat):
    """tool_choice="required": the output is constrained to a JSON array of {"name", "parameters"} objects."""

    arguments_keys = ("parameters",)

    def segments(self, text: str, final: bool) -> tuple[str, list[Body]]:
        rest = text.lstrip()
        if not rest.startswith("["):
            return (text if final else ""), []
        return "", json_sequence(rest[1:], ",]")

    def parse(self, text: str) -> ParsedOutput:
        """The calls, the last as far as it came when max_tokens cut the array short (a call whose name was cut
        is left out): the grammar made the output calls, so it is answered as calls."""
        _, bodies = self.segments(text, final=True)
        calls = [_json_object(body.text) or _json_object(body.text, Allow.ALL) for body in bodies]
        return ParsedOutput(
            None, [ToolCall(c["name"], dump_arguments(self.arguments_of(c))) for c in calls if c is not None]
        )


TOOL_PARSERS: dict[str, type[ToolFormat]] = {"hermes": HermesFormat, "llama3_json": Llama3JsonFormat}


def dump_arguments(arguments) -> str:
    return json.dumps(arguments, ensure_ascii=False)


class StreamingToolParser:
    """Deltas of content and tool calls from the deltas of a model's text, in OpenAI's streaming shape."""

    def __init__(self, format: ToolFormat) -> None:
        self.format = format
        self._text = ""
        self._content_sent = ""
        self._calls: list[tuple[str, str]] = []  # per call: its id, arguments sent

    def feed(self, delta_text: str) -> StreamDelta:
        self._text += delta_text
        return self._advance(final=False)

    def finish(self) -> StreamDelta:
        """What the last deltas held back (a tag's possible start), once the output is done."""
        return self._advance(final=True)

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def _advance(self, final: bool) -> StreamDelta:
        content, bodies = self.format.segments(self._text, final)
        out = StreamDelta()
        if content.startswith(self._content_sent):
            out.content, self._content_sent = content[len(self._content_sent) :], content
        for index, body in enumerate(bodies):
            name, arguments = self._read(body, final)
            if index == len(self._calls):
                if name is None:
                    break
                self._calls.append((new_call_id(), ""))
                out.tool_calls.append(ToolCallDelta(index, "", self._calls[index][0], name))
            call_id, sent = self._calls[index]
            if arguments.startswith(sent) and len(arguments) > len(sent):
                out.add(StreamDelta(tool_calls=[ToolCallDelta(index, arguments[len(sent) :])]))
                self._calls[index] = (call_id, arguments)
        return out

    def _read(self, body: Body, final: bool) -> tuple[str | None, str]:
        """A call's name (once whole) and the part of its arguments' JSON that can no longer change."""
        if body.complete or final:
            call = _json_object(body.text)
            return (
                (None, "") if call is None else (call["name"], dump_arguments(self.format.arguments_of(call)))
            )
        named = _json_object(body.text, _COMPLETE_STRINGS_ONLY)
        if named is None:
            return None, ""
        partial = _json_object(body.text, _PARTIAL_ARGUMENTS) or {}
        if not any(key in partial for key in self.format.arguments_keys):
            return named["name"], ""
        # Completing partial JSON closes its strings, arrays and objects: what may still change is at the end.
        return named["name"], dump_arguments(self.format.arguments_of(partial)).rstrip('"]}')
