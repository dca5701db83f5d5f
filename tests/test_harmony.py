"""gpt-oss's chat format (server/harmony.py): OpenAI chat requests rendered as the harmony messages one would build
by hand with openai_harmony, and harmony replies (encoded by openai_harmony itself) read back into reasoning,
content and tool calls, whole and streamed alike; the o200k vocabulary written offline (server/harmony_vocab.py)."""

from __future__ import annotations

import hashlib
import json

import pytest
from jpaged_server import harmony_vocab
from jpaged_server.errors import APIError
from jpaged_server.harmony import HarmonyChat
from jpaged_server.protocol import ChatCompletionRequest
from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

DATE = "2026-12-07"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL_ARGUMENTS = '{"city": "Paris"}'
CONVERSATION = [
    {"role": "system", "content": "Answer in one sentence."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": CALL_ARGUMENTS},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
]


@pytest.fixture(scope="module")
def chat() -> HarmonyChat:
    return HarmonyChat.load()


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": CONVERSATION, **fields})


def by_hand(chat: HarmonyChat, effort: ReasoningEffort) -> list[int]:
    """The same conversation built with openai_harmony directly, as its README builds one."""
    weather = WEATHER["function"]
    messages = [
        Message.from_role_and_content(
            Role.SYSTEM,
            SystemContent.new().with_reasoning_effort(effort).with_conversation_start_date(DATE),
        ),
        Message.from_role_and_content(
            Role.DEVELOPER,
            DeveloperContent.new()
            .with_instructions("Answer in one sentence.")
            .with_function_tools(
                [ToolDescription.new(weather["name"], weather["description"], weather["parameters"])]
            ),
        ),
        Message.from_role_and_content(Role.USER, "What is the weather in Paris?"),
        Message.from_role_and_content(Role.ASSISTANT, CALL_ARGUMENTS)
        .with_channel("commentary")
        .with_recipient("functions.get_weather")
        .with_content_type("json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), '{"celsius": 21}')
        .with_channel("commentary")
        .with_recipient("assistant"),
    ]
    return chat.encoding.render_conversation_for_completion(
        Conversation.from_messages(messages), Role.ASSISTANT
    )


def test_a_conversation_with_tools_a_call_and_its_result_renders_as_harmony_built_by_hand(chat):
    prompt = chat.prompt(request(tools=[WEATHER], reasoning_effort="low"), start_date=DATE)
    assert prompt.ids == by_hand(chat, ReasoningEffort.LOW)
    text = chat.encoding.decode(prompt.ids)
    assert text.startswith("<|start|>system<|message|>") and "Reasoning: low" in text
    assert f"Current date: {DATE}" in text
    assert "<|start|>developer<|message|># Instructions\n\nAnswer in one sentence." in text
    assert (
        "namespace functions {\n\n// The weather in a city\ntype get_weather = (_: {\ncity: string,\n}) => any;"
        in (text)
    )
    assert (
        f"<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{CALL_ARGUMENTS}<|call|>"
        in text
    )
    assert (
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"celsius": 21}<|end|>'
        in text
    )
    assert text.endswith("<|start|>assistant")
    stops = {chat.encoding.decode([t]) for t in prompt.stop_token_ids}
    assert stops == {"<|return|>", "<|call|>"}


def test_reasoning_effort_defaults_to_harmonys_medium_and_other_values_are_refused(chat):
    assert "Reasoning: medium" in chat.encoding.decode(chat.prompt(request(), start_date=DATE).ids)
    high = chat.prompt(request(chat_template_kwargs={"reasoning_effort": "high"}), start_date=DATE)
    assert "Reasoning: high" in chat.encoding.decode(high.ids)
    with pytest.raises(APIError) as refused:
        chat.prompt(request(reasoning_effort="extreme"))
    assert refused.value.status == 400 and refused.value.param == "reasoning_effort"


def test_earlier_reasoning_and_answers_go_to_their_channels(chat):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": CONVERSATION[2]["tool_calls"]},
        {"role": "function", "name": "get_weather", "content": "sunny"},
    ]
    text = chat.encoding.decode(chat.prompt(request(messages=messages, tools=[WEATHER])).ids)
    # the reasoning of a turn that ended on final is dropped (gpt-oss's template), its answer stays
    assert "Greet back." not in text and "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>" in text
    messages[3]["reasoning"] = "Call the tool."  # the turn still at work keeps its reasoning
    text = chat.encoding.decode(chat.prompt(request(messages=messages, tools=[WEATHER])).ids)
    assert "<|start|>assistant<|channel|>analysis<|message|>Call the tool.<|end|>" in text
    assert "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>" in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>" in text
    assert "# Instructions" not in text  # no system message: the developer message holds the tools only


def test_tool_choice_none_hides_the_tools_and_forced_calls_are_refused(chat):
    none = chat.encoding.decode(chat.prompt(request(tools=[WEATHER], tool_choice="none")).ids)
    assert "namespace functions" not in none
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(APIError) as refused:
            chat.prompt(request(tools=[WEATHER], tool_choice=choice))
        assert refused.value.status == 400 and refused.value.param == "tool_choice"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
        ({"messages": [{"role": "tool", "content": "?"}]}, "messages[0]"),
        ({"functions": [WEATHER["function"]], "tools": [WEATHER]}, "functions"),
    ],
)
def test_what_harmony_cannot_serve_is_a_400_naming_the_field(chat, fields, param):
    with pytest.raises(APIError) as refused:
        chat.prompt(request(**fields))
    assert refused.value.status == 400 and refused.value.param == param


def completion(chat: HarmonyChat, *messages: Message) -> list[int]:
    """The tokens a model writes after the prompt's `<|start|>assistant`, encoded by openai_harmony."""
    ids = [token for message in messages for token in chat.encoding.render(message)]
    assert chat.encoding.decode(ids[:2]) == "<|start|>assistant"
    return ids[2:]


def assistant(channel: str, text: str, to: str | None = None) -> Message:
    message = Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)
    return message.with_recipient(to).with_content_type("<|constrain|>json") if to else message


THINKING = assistant("analysis", "The user greets me. Reply kindly, maybe with 🌍.")
ANSWER = assistant("final", "Hello! How can I help? 🌍")
CALL = assistant("commentary", '{"city": "Oslo", "days": 3}', to="functions.get_weather")


def streamed(chat: HarmonyChat, tokens: list[int], size: int, **reply_fields) -> list[dict]:
    reply = chat.prompt(request(tools=[WEATHER], **reply_fields)).reply
    stream = reply.streaming()
    pieces = [tokens[i : i + size] for i in range(0, len(tokens), size)]
    deltas = [stream.feed("", i == len(pieces) - 1, piece) for i, piece in enumerate(pieces)]
    return [d.model_dump() for d in deltas if not d.is_empty()]


def joined(deltas: list[dict], key: str) -> str:
    return "".join(d.get(key) or "" for d in deltas)


def test_analysis_is_the_reasoning_and_final_the_content(chat):
    tokens = completion(chat, THINKING, ANSWER)
    message = chat.prompt(request()).reply.message("", tokens).model_dump()
    parsed = chat.encoding.parse_messages_from_completion_tokens(tokens, Role.ASSISTANT)
    assert [m.channel for m in parsed] == ["analysis", "final"]
    assert message == {
        "role": "assistant",
        "content": parsed[1].content[0].text,
        "reasoning": parsed[0].content[0].text,
        "reasoning_content": parsed[0].content[0].text,
    }


def test_a_commentary_message_to_a_function_is_a_tool_call(chat):
    tokens = completion(chat, THINKING, CALL)
    message = chat.prompt(request(tools=[WEATHER])).reply.message("", tokens).model_dump()
    assert message["content"] is None and message["reasoning"] == THINKING.content[0].text
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": CALL.content[0].text}
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "days": 3}


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
@pytest.mark.parametrize("ending", [ANSWER, CALL], ids=["final", "call"])
def test_streamed_deltas_concatenate_to_the_whole_reply(chat, size, ending):
    tokens = completion(chat, THINKING, assistant("analysis", "Second thought."), ending)
    whole = chat.prompt(request(tools=[WEATHER])).reply.message("", tokens).model_dump()
    assert whole["reasoning"] == THINKING.content[0].text + "\nSecond thought."
    deltas = streamed(chat, tokens, size)
    assert joined(deltas, "reasoning") == joined(deltas, "reasoning_content") == whole["reasoning"]
    assert (joined(deltas, "content") or None) == whole["content"]
    pieces = [c for d in deltas for c in d.get("tool_calls") or []]
    for delta in deltas:  # one entry a call index in any delta, as OpenAI streams them
        indices = [c["index"] for c in delta.get("tool_calls") or []]
        assert len(indices) == len(set(indices))
    if ending is CALL:
        [call] = whole["tool_calls"]
        assert pieces[0]["id"].startswith("call_") and pieces[0]["function"]["name"] == "get_weather"
        assert all("id" not in p and "name" not in p["function"] for p in pieces[1:])
        assert joined([p["function"] for p in pieces], "arguments") == call["function"]["arguments"]
    else:
        assert not pieces and "tool_calls" not in whole


def test_include_reasoning_false_and_legacy_functions_shape_the_reply(chat):
    tokens = completion(chat, THINKING, CALL)
    reply = chat.prompt(request(include_reasoning=False, functions=[WEATHER["function"]])).reply
    message = reply.message("", tokens).model_dump()
    assert "reasoning" not in message and "tool_calls" not in message
    assert message["function_call"] == {"name": "get_weather", "arguments": CALL.content[0].text}
    deltas = streamed(chat, tokens, 3, include_reasoning=False)
    assert not joined(deltas, "reasoning") and [d for d in deltas if d.get("tool_calls")]


def test_a_reply_cut_short_or_off_format_keeps_what_was_read(chat):
    reply = chat.prompt(request()).reply
    tokens = completion(chat, THINKING, ANSWER)
    cut = tokens[:-4]  # max_tokens ended the answer
    assert ANSWER.content[0].text.startswith(reply.message("", cut).content)
    header = tokens[: len(completion(chat, THINKING)) + 3]  # cut inside the answer's header
    assert (
        reply.message("", header).model_dump() == reply.message("", completion(chat, THINKING)).model_dump()
    )
    broken = [*completion(chat, THINKING), *chat.encoding.encode("no header here", allowed_special="all")]
    assert reply.message("", broken).reasoning == THINKING.content[0].text
    assert reply.message("", broken).content is None


def test_the_vocabulary_is_written_from_quicktok_checked_and_reused(tmp_path, monkeypatch):
    monkeypatch.delenv(harmony_vocab.ENCODINGS_BASE, raising=False)
    monkeypatch.setenv("JPAGED_CACHE_DIR", str(tmp_path))
    directory = harmony_vocab.ensure_encodings_base()
    path = directory / harmony_vocab.FILE_NAME
    assert directory == tmp_path / "tiktoken"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == harmony_vocab.SHA256
    import os

    assert os.environ[harmony_vocab.ENCODINGS_BASE] == str(directory)
    monkeypatch.delenv(harmony_vocab.ENCODINGS_BASE)
    path.write_bytes(b"damaged")  # a damaged copy is written again
    harmony_vocab.ensure_encodings_base()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == harmony_vocab.SHA256


def test_a_named_directory_is_used_as_it_is_and_without_quicktok_the_error_says_what_to_do(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(harmony_vocab.ENCODINGS_BASE, str(tmp_path / "mine"))
    assert harmony_vocab.ensure_encodings_base() == tmp_path / "mine"
    monkeypatch.delenv(harmony_vocab.ENCODINGS_BASE)
    monkeypatch.setenv("JPAGED_CACHE_DIR", str(tmp_path))

    def missing(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(harmony_vocab.importlib.resources, "files", missing)
    with pytest.raises(harmony_vocab.VocabularyUnavailable, match="quicktok-v1.*TIKTOKEN_ENCODINGS_BASE"):
        harmony_vocab.ensure_encodings_base()


def test_quicktoks_layout_becomes_tiktoken_lines():
    vocab = b"\x02\x00\x00\x00" + b"\x01\x00a\x00\x00\x00\x00" + b"\x02\x00\xff\x20\x07\x00\x00\x00"
    assert harmony_vocab.tiktoken_file(vocab) == b"YQ== 0\n/yA= 7\n"
    with pytest.raises(harmony_vocab.VocabularyUnavailable):
        harmony_vocab.tiktoken_file(vocab + b"\x00")
