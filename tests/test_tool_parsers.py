"""Tool-call and reasoning parsers on outputs written the way the models write them. A stream is fed in every
possible split (each split point into two deltas, and one character at a time): whatever the split, the deltas
must add up to exactly what the whole-output parser says, and no piece of a tag may leak into the content."""

from __future__ import annotations

import json

import pytest
from jpaged_server.reasoning_parsers import REASONING_PARSERS, StreamingReasoningParser
from jpaged_server.tool_parsers import (
    HermesFormat,
    Llama3JsonFormat,
    RequiredArrayFormat,
    StreamingToolParser,
)

WEATHER = (
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 12, "units": ["c", "f"], "x": null}}'
)
HERMES = {
    "one_call": (f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", WEATHER)]),
    "text_then_parallel_calls": (
        'Let me check.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"q": "tag </tool in a string", "n": -1.5e3}}\n</tool_call>',
        "Let me check.",
        [
            ("a", '{"name": "a", "arguments": {}}'),
            ("b", '{"arguments": {"q": "tag </tool in a string", "n": -1.5e3}}'),
        ],
    ),
    "no_call": ("The answer is <b>42</b> < 43.", "The answer is <b>42</b> < 43.", []),
    "unicode_and_escapes": (
        '<tool_call>{"name": "say", "arguments": {"text": "สวัสดี \\"quoted\\" \\\\ \\n"}}</tool_call>',
        None,
        [("say", '{"arguments": {"text": "สวัสดี \\"quoted\\" \\\\ \\n"}}')],
    ),
}
LLAMA = {
    "one_call": (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", '{"parameters": {"city": "Paris"}}')],
    ),
    "python_tag_and_two_calls": (
        '<|python_tag|>{"name": "a", "parameters": {"n": 1}}; {"name": "b", "parameters": {"l": [true, false]}}',
        None,
        [("a", '{"parameters": {"n": 1}}'), ("b", '{"parameters": {"l": [true, false]}}')],
    ),
    "plain_text": ("Paris is sunny {today}.", "Paris is sunny {today}.", []),
}
REQUIRED = {
    "two_calls": (
        '[{"name": "a", "parameters": {"s": "x]y"}}, {"name": "b", "parameters": {}}]',
        None,
        [("a", '{"parameters": {"s": "x]y"}}'), ("b", '{"parameters": {}}')],
    ),
}
CASES = [
    *((HermesFormat(), name, *case) for name, case in HERMES.items()),
    *((Llama3JsonFormat(), name, *case) for name, case in LLAMA.items()),
    *((RequiredArrayFormat(), name, *case) for name, case in REQUIRED.items()),
]
IDS = [f"{type(fmt).__name__}-{name}" for fmt, name, *_ in CASES]


def expected_calls(calls: list[tuple[str, str]], fmt) -> list[tuple[str, dict]]:
    return [(name, fmt.arguments_of(json.loads(text))) for name, text in calls]


def splits(text: str):
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


def stream(fmt, deltas: list[str]) -> tuple[str, dict[int, list]]:
    parser = StreamingToolParser(fmt)
    content, calls = "", {}
    for delta in [*map(parser.feed, deltas), parser.finish()]:
        content += delta.content
        for piece in delta.tool_calls:
            if piece.name is not None:
                assert piece.index not in calls and piece.id.startswith("call_")
                calls[piece.index] = [piece.name, ""]
            calls[piece.index][1] += piece.arguments
    return content, calls


@pytest.mark.parametrize(("fmt", "name", "text", "content", "calls"), CASES, ids=IDS)
def test_the_whole_output_parses_to_its_content_and_calls(fmt, name, text, content, calls):
    parsed = fmt.parse(text)
    assert parsed.content == content
    got = [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]
    assert got == expected_calls(calls, fmt)


@pytest.mark.parametrize(("fmt", "name", "text", "content", "calls"), CASES, ids=IDS)
def test_every_split_of_the_stream_adds_up_to_the_whole_parse(fmt, name, text, content, calls):
    whole = fmt.parse(text)
    for deltas in splits(text):
        streamed_content, streamed_calls = stream(fmt, deltas)
        assert streamed_content.strip() == (whole.content or ""), deltas
        assert [tuple(streamed_calls[i]) for i in sorted(streamed_calls)] == [
            (call.name, call.arguments) for call in whole.tool_calls
        ], deltas


def test_a_tag_split_across_deltas_never_reaches_the_content():
    parser = StreamingToolParser(HermesFormat())
    sent = [
        parser.feed(piece).content for piece in ("Sure <tool", "_ca", 'll>{"name": "f", "arguments": {}}')
    ]
    assert "".join(sent) == "Sure "
    assert sent[0] == "Sure "  # the space is safe; "<tool" waited


def test_arguments_stream_in_pieces_before_the_call_ends():
    parser = StreamingToolParser(HermesFormat())
    pieces = []
    for piece in (
        '<tool_call>{"name": "f", "arguments": {"text": "a long',
        " argument",
        ' here"',
        "}}</tool_call>",
    ):
        pieces += [d.arguments for d in parser.feed(piece).tool_calls if d.arguments]
    assert len(pieces) >= 3 and "".join(pieces) == '{"text": "a long argument here"}'


def test_an_unfinished_call_is_content_in_the_whole_parse():
    text = '<tool_call>{"name": "f", "arguments": {"a": '
    assert HermesFormat().parse(text).tool_calls == []
    assert HermesFormat().parse(text).content == text


THINK = {
    "qwen3": [
        ("<think>\nThe user greets.\n</think>\n\nHello!", "The user greets.", "\n\nHello!"),
        ("Hello without thinking", None, "Hello without thinking"),
        ("<think>cut off mid-thought", "cut off mid-thought", ""),
        ("<thinking> is not the tag", None, "<thinking> is not the tag"),
    ],
    "deepseek_r1": [
        ("The template opened the block.</think>Answer.", "The template opened the block.", "Answer."),
        ("<think>opened here</think>Answer.", "opened here", "Answer."),
        ("still thinking", "still thinking", ""),
    ],
}
THINK_CASES = [(name, *case) for name, cases in THINK.items() for case in cases]


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), THINK_CASES)
def test_reasoning_is_split_from_the_answer_whole_and_in_every_split_stream(parser, text, reasoning, content):
    fmt = REASONING_PARSERS[parser]
    assert fmt.parse(text) == (reasoning, content)
    for deltas in splits(text):
        streaming = StreamingReasoningParser(fmt)
        got_reasoning, got_content = "", ""
        for new_reasoning, new_content in [*map(streaming.feed, deltas), streaming.finish()]:
            got_reasoning += new_reasoning
            got_content += new_content
            assert "<" not in got_reasoning or "<" in (reasoning or ""), deltas
        assert (got_reasoning.strip() or None, got_content) == (reasoning, content), deltas
