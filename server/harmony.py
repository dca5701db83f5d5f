"""gpt-oss's chat format, harmony, through openai_harmony: the prompt rendered from the request, the reply read
from its token ids. The server picks it for a gpt-oss model (api_server.build_app), as vLLM does, in place of the
chat template, --reasoning-parser and --tool-call-parser.

The request as harmony messages:
  * a system message: harmony's, with the request's `reasoning_effort` (low, medium, high) and today's date;
  * a developer message, when there is something to put in it: the system and developer messages' text as its
    instructions, and the request's function tools (`tools`, or the legacy `functions`) as harmony's `functions`
    namespace (tool_choice "none" leaves them out, so the reply is text);
  * the conversation: user messages; an assistant's reasoning on the analysis channel (left out before the last
    answer, as gpt-oss's template does), its earlier tool calls on commentary to=functions.NAME (its text beside
    calls as a commentary preamble, otherwise on final); a tool's reply from functions.NAME (the name from the
    message, or from the call its tool_call_id answers).

The reply, token by token (StreamableParser), whole or as deltas: analysis messages are the reasoning,
final and commentary messages without a recipient the content, messages to functions.NAME tool calls with the
message as their arguments; messages of one kind are joined by a newline. A reply that breaks the format
(harmony's parser refuses a token) keeps what was read before it.
"""

from __future__ import annotations

import datetime
import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from jpaged_server.chat_template import ChatPrompt
from jpaged_server.errors import APIError
from jpaged_server.harmony_vocab import ensure_encodings_base
from jpaged_server.protocol import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatMessage,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    FunctionDefinition,
    ToolCallOut,
)
from jpaged_server.structured_request import requested_spec
from jpaged_server.tool_parsers import ToolCall, ToolCallDelta
from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyEncoding,
    HarmonyEncodingName,
    HarmonyError,
    Message,
    ReasoningEffort,
    Role,
    StreamableParser,
    SystemContent,
    ToolDescription,
    load_harmony_encoding,
)

logger = logging.getLogger(__name__)

REASONING_EFFORTS = {
    "low": ReasoningEffort.LOW,
    "medium": ReasoningEffort.MEDIUM,
    "high": ReasoningEffort.HIGH,
}
FUNCTIONS = "functions."  # the namespace harmony gives function tools
MESSAGE = "<|message|>"


def load_encoding() -> HarmonyEncoding:
    ensure_encodings_base()  # o200k_base from the cache, without the network
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


@dataclass(frozen=True, slots=True)
class HarmonyChat:
    """The server's harmony: prompts for chat requests and readers of their replies."""

    encoding: HarmonyEncoding

    @classmethod
    def load(cls) -> HarmonyChat:
        return cls(load_encoding())

    def prompt(self, body: ChatCompletionRequest, start_date: str | None = None) -> ChatPrompt:
        """The request's prompt ids, stop tokens (the end of the assistant's turn: <|return|>, <|call|>) and
        reply format; 400s for what harmony cannot serve here."""
        _check_servable(body)
        tools, legacy = request_tools(body)
        messages = harmony_messages(body, tools, start_date or datetime.date.today().isoformat())
        ids = self.encoding.render_conversation_for_completion(
            Conversation.from_messages(messages), Role.ASSISTANT
        )
        reply = HarmonyReply(self.encoding, body.include_reasoning, legacy)
        return ChatPrompt(ids, reply, stop_token_ids=self.encoding.stop_tokens_for_assistant_actions())


def _check_servable(body: ChatCompletionRequest) -> None:
    if body.continue_final_message or not body.add_generation_prompt:
        param = "continue_final_message" if body.continue_final_message else "add_generation_prompt"
        raise APIError(400, f"{param}: harmony (gpt-oss) always renders the assistant's next message", param)
    if (asked := requested_spec(body)) is not None:
        param = asked[1]
        raise APIError(400, f"{param} is not supported for gpt-oss (harmony) models yet", param)


def request_tools(body: ChatCompletionRequest) -> tuple[list[FunctionDefinition], bool]:
    """The functions the model is shown, and whether they came as the legacy `functions`. Harmony's model calls
    tools by itself: tool_choice "auto" (the default) or "none"; a forced call is refused."""
    legacy = body.functions is not None or body.function_call is not None
    if legacy and (body.tools is not None or body.tool_choice is not None):
        raise APIError(
            400,
            "give tools and tool_choice, or the legacy functions and function_call, not both",
            "functions",
        )
    functions = list(body.functions or ()) if legacy else [tool.function for tool in body.tools or ()]
    param = "function_call" if legacy else "tool_choice"
    choice = body.function_call if legacy else body.tool_choice
    if choice not in (None, "auto", "none"):
        raise APIError(
            400,
            f'{param}: gpt-oss (harmony) models choose their calls themselves; use "auto" or "none"',
            param,
        )
    if choice not in (None, "none") and not functions:
        raise APIError(400, f"{param} needs tools", param)
    return ([] if choice == "none" else functions), legacy


def harmony_messages(
    body: ChatCompletionRequest, tools: list[FunctionDefinition], start_date: str
) -> list[Message]:
    effort = body.reasoning_effort or (body.chat_template_kwargs or {}).get("reasoning_effort")
    system = SystemContent.new().with_conversation_start_date(start_date)
    if effort is not None:
        if str(effort).lower() not in REASONING_EFFORTS:
            raise APIError(
                400, f"reasoning_effort must be one of low, medium, high; got {effort!r}", "reasoning_effort"
            )
        system = system.with_reasoning_effort(REASONING_EFFORTS[str(effort).lower()])
    messages = [Message.from_role_and_content(Role.SYSTEM, system)]
    instructions = "\n\n".join(m.text() for m in body.messages if m.role in ("system", "developer"))
    if instructions or tools:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if tools:
            developer = developer.with_function_tools(
                [ToolDescription.new(f.name, f.description or "", f.parameters) for f in tools]
            )
        messages.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    called = {call.id: call.function.name for m in body.messages for call in m.tool_calls or ()}
    for index, message in enumerate(body.messages):
        messages += _conversation_message(message, called, index)
    return _without_answered_reasoning(messages)


def _without_answered_reasoning(messages: list[Message]) -> list[Message]:
    """The reasoning before the last answer (final channel) left out, as gpt-oss's own chat template does and
    harmony's guide asks: the model sees its reasoning only within the turn it is still working on."""
    finals = [i for i, m in enumerate(messages) if m.author.role == Role.ASSISTANT and m.channel == "final"]
    if not finals:
        return messages
    return [m for i, m in enumerate(messages) if i > finals[-1] or m.channel != "analysis"]


def _conversation_message(message: ChatMessage, called: dict[str, str], index: int) -> list[Message]:
    text = message.text()
    if message.role == "user":
        return [Message.from_role_and_content(Role.USER, text)]
    if message.role in ("tool", "function"):
        name = message.name or called.get(message.tool_call_id or "")
        if name is None:
            raise APIError(
                400,
                "a tool message needs the name of its function, or the tool_call_id of an earlier call",
                f"messages[{index}]",
            )
        reply = Message.from_author_and_content(Author.new(Role.TOOL, FUNCTIONS + name), text)
        return [reply.with_channel("commentary").with_recipient("assistant")]
    if message.role != "assistant":
        return []  # system and developer: the developer message's instructions
    out = []
    reasoning = message.reasoning or message.reasoning_content
    if reasoning:
        out.append(Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis"))
    calls = [call.function for call in message.tool_calls or ()]
    if message.function_call is not None:
        calls.append(message.function_call)
    if text:
        channel = "commentary" if calls else "final"  # text beside calls is their preamble
        out.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel))
    for call in calls:
        out.append(
            Message.from_role_and_content(Role.ASSISTANT, call.arguments)
            .with_channel("commentary")
            .with_recipient(FUNCTIONS + call.name)
            .with_content_type("json")
        )
    return out


@functools.cache
def _message_token(encoding: HarmonyEncoding) -> int:
    """<|message|>, which ends a message's header."""
    [token] = encoding.encode(MESSAGE, allowed_special={MESSAGE})
    return token


@dataclass(slots=True)
class _Reading:
    """What the reply said: all of it so far (`calls` as ToolCall), or its latest delta (as ToolCallDelta)."""

    reasoning: str = ""
    content: str = ""
    calls: list = field(default_factory=list)

    def add(self, kind: str, text: str) -> None:
        setattr(self, kind, getattr(self, kind) + text)


class HarmonyStream:
    """One choice's reply read token by token; `feed` answers with the delta in OpenAI's shape."""

    def __init__(self, reply: HarmonyReply) -> None:
        self.reply = reply
        self._parser = StreamableParser(reply.encoding, Role.ASSISTANT)
        self._message_token = _message_token(reply.encoding)
        self._broken = False
        # The message being read: "reasoning", "content", "call" or None (not the assistant's: skipped).
        self._kind: str | None = None
        # Whether a message of the kind came before: a later one starts on a new line.
        self._said = {"reasoning": False, "content": False}
        self.whole = _Reading()

    @property
    def called(self) -> bool:
        return bool(self.whole.calls)

    def feed(self, text: str = "", final: bool = False, token_ids: Iterable[int] = ()) -> DeltaMessage:
        """The delta for the reply's next tokens (`text` is not read: harmony's markers are special tokens)."""
        new = _Reading()
        for token in token_ids:
            self._take(token, new)
        return self.reply.delta(new)

    def finish(self) -> DeltaMessage:
        return self.reply.delta(_Reading())

    def _take(self, token: int, new: _Reading) -> None:
        if self._broken:
            return
        parser = self._parser
        try:
            parser.process(token)
        except HarmonyError as err:  # the model broke the format: keep what came before
            logger.info("harmony reply ends unparsed at token %d: %s", token, err)
            self._broken = True
            return
        if parser.current_role is None:  # between messages
            self._kind = None
            return
        if token == self._message_token:  # a message's header is complete: what it is
            self._kind = self._start(parser, new)
        delta = parser.last_content_delta
        if not delta or self._kind is None:
            return
        if self._kind == "call":
            call = self.whole.calls[-1]
            call.arguments += delta
            index = len(self.whole.calls) - 1
            mine = next((c for c in new.calls if c.index == index), None)
            if mine is None:
                new.calls.append(ToolCallDelta(index, delta))
            else:
                mine.arguments += delta
        else:
            new.add(self._kind, delta)
            self.whole.add(self._kind, delta)

    def _start(self, parser: StreamableParser, new: _Reading) -> str | None:
        if parser.current_role != Role.ASSISTANT:
            return None  # the model wrote a tool's reply itself: not the assistant's
        recipient = parser.current_recipient or ""
        if recipient.startswith(FUNCTIONS):
            call = ToolCall(recipient[len(FUNCTIONS) :], "")
            new.calls.append(ToolCallDelta(len(self.whole.calls), "", call.id, call.name))
            self.whole.calls.append(call)
            return "call"
        # A message to another recipient (a built-in tool the request did not offer) is the model's own work.
        kind = "reasoning" if parser.current_channel == "analysis" or recipient else "content"
        if self._said[kind]:
            new.add(kind, "\n")
            self.whole.add(kind, "\n")
        self._said[kind] = True
        return kind


@dataclass(frozen=True, slots=True)
class HarmonyReply:
    """A harmony reply as OpenAI's message (chat_message.ReplyFormat's counterpart)."""

    encoding: HarmonyEncoding
    include_reasoning: bool = True
    legacy_functions: bool = False  # a call answers as `function_call` (the request gave `functions`)

    def streaming(self) -> HarmonyStream:
        return HarmonyStream(self)

    def message(self, text: str = "", token_ids: Iterable[int] = ()) -> AssistantMessage:
        stream = self.streaming()
        stream.feed(token_ids=token_ids, final=True)
        read = stream.whole
        reasoning = (read.reasoning or None) if self.include_reasoning else None
        outs = [FunctionCallOut(name=c.name, arguments=c.arguments) for c in read.calls]
        message = AssistantMessage(
            content=read.content or None, reasoning=reasoning, reasoning_content=reasoning
        )
        if self.legacy_functions:
            message.function_call = next(iter(outs), None)
        else:
            message.tool_calls = [
                ToolCallOut(id=c.id, function=out) for c, out in zip(read.calls, outs, strict=True)
            ] or None
        return message

    def delta(self, new: _Reading) -> DeltaMessage:
        reasoning = new.reasoning if self.include_reasoning else ""
        delta = DeltaMessage(
            content=new.content or None, reasoning=reasoning or None, reasoning_content=reasoning or None
        )
        if self.legacy_functions:
            first = next((c for c in new.calls if c.index == 0), None)
            if first is not None:
                delta.function_call = FunctionCallOut(name=first.name, arguments=first.arguments)
        elif new.calls:
            delta.tool_calls = [
                DeltaToolCall(
                    index=c.index,
                    id=c.id,
                    type="function" if c.id else None,
                    function=FunctionCallOut(name=c.name, arguments=c.arguments),
                )
                for c in new.calls
            ]
        return delta
