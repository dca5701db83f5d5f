"""Structured outputs end to end: the official `openai` client against a real server on the embedded model, the
grammar's bitmask applied on device. Whatever the small model would say, the outputs parse and validate."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from jpaged_server.api_server import build_app
from json_schemas import OBJECT_SCHEMAS
from server_harness import serve_in_thread, shared_engine

from jpaged.config import EngineConfig

pytestmark = pytest.mark.slow
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "days": {"type": "integer", "minimum": 1},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def client(default_gguf):
    config = EngineConfig(
        model=str(default_gguf),
        max_num_seqs=32,
        max_num_batched_tokens=512,
        max_model_len=1024,
        num_blocks=512,
    )
    with serve_in_thread(build_app(shared_engine(config), "default")) as running:
        yield openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0, timeout=600)


def chat_text(client, stream: bool, **kwargs) -> tuple[str, str]:
    """The reply's text and finish reason, from one response or from its stream's deltas."""
    if not stream:
        choice = client.chat.completions.create(model="default", temperature=0, **kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(model="default", temperature=0, stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_replies_validate_for_twenty_schemas(client, stream):
    def ask(schema):
        fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}
        messages = [{"role": "user", "content": "Describe a product as JSON."}]
        return chat_text(client, stream, messages=messages, response_format=fmt, max_tokens=400)

    with ThreadPoolExecutor(len(OBJECT_SCHEMAS)) as pool:
        replies = list(pool.map(ask, OBJECT_SCHEMAS))
    for schema, (text, reason) in zip(OBJECT_SCHEMAS, replies, strict=True):
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_regex_and_choice_replies_match(client, stream):
    text, _ = chat_text(client, stream, messages=ASK, response_format={"type": "json_object"}, max_tokens=200)
    assert isinstance(json.loads(text), dict)
    pattern = r"[A-Z][a-z]{2,8} \d{1,2}"
    text, _ = chat_text(client, stream, messages=ASK, extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, text), text
    choices = ["sunny", "rainy", "cloudy"]
    text, _ = chat_text(client, stream, messages=ASK, extra_body={"structured_outputs": {"choice": choices}})
    assert text in choices


def test_completions_follow_structured_outputs(client):
    pattern = r"\d{3}-\d{4}"
    response = client.completions.create(
        model="default",
        prompt="Call me at",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert re.fullmatch(pattern, response.choices[0].text), response.choices[0].text


def streamed_calls(client, **kwargs) -> tuple[list[tuple[str, str]], str]:
    calls, reason = {}, None
    for chunk in client.chat.completions.create(model="default", temperature=0, stream=True, **kwargs):
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for piece in choice.delta.tool_calls or []:
                if piece.function.name:
                    calls[piece.index] = [piece.function.name, ""]
                calls[piece.index][1] += piece.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)], reason


def whole_calls(client, **kwargs) -> tuple[list[tuple[str, str]], str]:
    choice = client.chat.completions.create(model="default", temperature=0, **kwargs).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return calls, choice.finish_reason


TOOLS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.mark.parametrize("read", [whole_calls, streamed_calls], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_forced_tool_calls_parse_and_their_arguments_validate(client, read, tool_choice):
    calls, reason = read(
        client,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        max_tokens=300,
        parallel_tool_calls=False,
    )
    assert reason == "tool_calls" and len(calls) == 1, calls
    name, arguments = calls[0]
    if isinstance(tool_choice, dict):
        assert name == "get_time"
    jsonschema.validate(json.loads(arguments), TOOLS[name]["function"]["parameters"])
