"""The request surface of structured outputs and tools: what is refused up front with a 400 naming the problem
(a schema, regex or grammar that does not compile, conflicting constraints, a tool_choice the server cannot
serve), and the reply assembled from a model's text (reasoning, then tool calls), whole and streamed alike."""

from __future__ import annotations

import argparse

import httpx
import pytest
from jpaged_server.api_server import build_app
from jpaged_server.chat_message import ReplyFormat, StreamingReply
from jpaged_server.cli import add_server_args, auto_tool_parser
from jpaged_server.reasoning_parsers import REASONING_PARSERS
from jpaged_server.tool_parsers import HermesFormat
from server_harness import assert_400, serve_in_thread, small_engine

HI = [{"role": "user", "content": "Hi"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def http(tiny_model_dir):
    with (
        serve_in_thread(build_app(small_engine(tiny_model_dir), "tiny")) as running,
        httpx.Client(base_url=running.base_url) as client,
    ):
        client.timeout = 120
        yield client


CHAT_REFUSALS = {
    "schema_that_does_not_compile": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "frob"}},
            }
        },
        "response_format",
        ["invalid JSON schema", "frob"],
    ),
    "json_schema_without_schema": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
        ["json_schema.schema"],
    ),
    "regex_that_does_not_compile": (
        {"structured_outputs": {"regex": "a(b"}},
        "structured_outputs",
        ["invalid regex", "unclosed group"],
    ),
    "two_constraints_in_structured_outputs": (
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        "structured_outputs",
        ["exactly one"],
    ),
    "both_fields": (
        {"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}},
        "structured_outputs",
        ["not both"],
    ),
    "auto_tool_choice_without_the_server_flag": (
        {"tools": [WEATHER_TOOL]},
        "tool_choice",
        ["--enable-auto-tool-choice"],
    ),
    "named_tool_that_is_not_given": (
        {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        ["'nope'"],
    ),
    "tool_choice_without_tools": ({"tool_choice": "required"}, "tool_choice", ["needs tools"]),
    "tool_parameters_that_do_not_compile": (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
            "tool_choice": "required",
        },
        "tools",
        ["invalid JSON schema"],
    ),
}


@pytest.mark.parametrize("case", CHAT_REFUSALS.values(), ids=CHAT_REFUSALS.keys())
@pytest.mark.parametrize("stream", [False, True])
def test_chat_refuses_with_a_400_naming_the_problem(http, case, stream):
    extra, param, words = case
    response = http.post("/v1/chat/completions", json={"messages": HI, "stream": stream, **extra})
    assert_400(response, param, *words)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_refuse_a_grammar_that_does_not_compile(http, stream):
    body = {"prompt": "x", "stream": stream, "structured_outputs": {"grammar": "start: undefined_rule"}}
    assert_400(http.post("/v1/completions", json=body), "structured_outputs", "invalid grammar")


def test_tools_with_tool_choice_none_reach_the_template_and_the_reply_is_text(http):
    body = {"messages": HI, "tools": [WEATHER_TOOL], "tool_choice": "none", "max_tokens": 4}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert (
        message["role"] == "assistant" and isinstance(message["content"], str) and "tool_calls" not in message
    )


def test_an_earlier_tool_call_and_its_result_go_back_through_the_template(http):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        *HI,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = {"messages": messages, "tools": [WEATHER_TOOL], "tool_choice": "none", "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


REPLY = (
    "<think>\nThe user wants weather.\n</think>\n\nChecking.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


def test_a_reply_splits_into_reasoning_content_and_tool_calls_whole_and_streamed_alike():
    fmt = ReplyFormat(REASONING_PARSERS["qwen3"], HermesFormat())
    whole = fmt.message(REPLY).model_dump()
    assert whole["reasoning"] == whole["reasoning_content"] == "The user wants weather."
    assert whole["content"] == "Checking."
    [call] = whole["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    for size in (1, 3, 7):
        streaming = StreamingReply(fmt)
        deltas = [streaming.feed(REPLY[i : i + size]) for i in range(0, len(REPLY), size)]
        deltas.append(streaming.finish())
        dumped = [d.model_dump() for d in deltas]
        assert "".join(d.get("reasoning", "") for d in dumped).strip() == whole["reasoning"]
        assert "".join(d.get("content", "") for d in dumped).strip() == whole["content"]
        pieces = [c for d in dumped for c in d.get("tool_calls", [])]
        assert pieces[0]["id"].startswith("call_") and pieces[0]["function"]["name"] == "get_weather"
        assert "".join(p["function"].get("arguments", "") for p in pieces) == call["function"]["arguments"]
        assert streaming.called
        for delta in dumped:  # one entry a call index in any delta, as OpenAI streams them
            indices = [c["index"] for c in delta.get("tool_calls", [])]
            assert len(indices) == len(set(indices))


def test_include_reasoning_false_drops_the_reasoning_whole_and_streamed():
    fmt = ReplyFormat(REASONING_PARSERS["qwen3"], HermesFormat(), include_reasoning=False)
    whole = fmt.message(REPLY).model_dump()
    assert "reasoning" not in whole and whole["content"] == "Checking." and whole["tool_calls"]
    streaming = StreamingReply(fmt)
    dumped = [streaming.feed(REPLY[i : i + 5]).model_dump() for i in range(0, len(REPLY), 5)]
    dumped.append(streaming.finish().model_dump())
    assert not any("reasoning" in d for d in dumped)
    assert "".join(d.get("content", "") for d in dumped).strip() == "Checking."


def test_serve_flags_turn_on_auto_tool_choice_only_with_a_parser():
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert auto_tool_parser(parser.parse_args([])) is None
    assert auto_tool_parser(parser.parse_args(["--tool-call-parser", "hermes"])) is None  # parser alone: off
    on = parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    assert auto_tool_parser(on) == "llama3_json"
    with pytest.raises(ValueError, match="--tool-call-parser"):
        auto_tool_parser(parser.parse_args(["--enable-auto-tool-choice"]))
    assert parser.parse_args(["--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
