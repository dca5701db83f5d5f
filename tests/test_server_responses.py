"""POST /v1/responses, OpenAI's Responses API as vLLM serves it: a request is served as the chat request its input
makes (same prompt, same greedy text), its reply returned as output items (reasoning, message, function calls),
whole or as OpenAI's event stream, which the official client parses; responses are stored (LRU-bounded) for
previous_response_id and GET /v1/responses/{id}."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from jpaged_server.api_server import build_app
from jpaged_server.cli import add_server_args
from jpaged_server.response_store import ResponseStore, StoredResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter
from server_harness import assert_400, serve_in_thread

MODEL = "tiny"
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
STORED = 8  # the server's --max-stored-responses


@pytest.fixture(scope="module")
def server(engine):
    with serve_in_thread(build_app(engine, MODEL, max_stored_responses=STORED)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def prompt_tokens(http: httpx.Client, messages: list[dict]) -> int:
    """The length of the chat prompt these messages make (the server's /tokenize)."""
    response = http.post("/tokenize", json={"model": MODEL, "messages": messages})
    assert response.status_code == 200, response.text
    return response.json()["count"]


def create(client, **kwargs):
    return client.responses.create(model=MODEL, **{"temperature": 0, "max_output_tokens": 8, **kwargs})


# --- whole responses ---


def test_string_input_is_one_user_message_answered_as_chat_answers_it(client, http):
    response = create(client, input="Hello there", text={"format": {"type": "text"}})
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    assert [item.type for item in response.output] == ["message"]
    messages = [{"role": "user", "content": "Hello there"}]
    chat = openai.OpenAI(base_url=str(client.base_url), api_key="unused").chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0
    )
    assert response.output_text == chat.choices[0].message.content


def test_usage_counts_the_chat_prompt_and_the_output_tokens(client, http):
    response = create(client, input="Hello there", max_output_tokens=5)
    usage = response.usage
    assert usage.input_tokens == prompt_tokens(http, [{"role": "user", "content": "Hello there"}])
    assert 1 <= usage.output_tokens <= 5
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens <= usage.input_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    if usage.output_tokens == 5:  # stopped by max_output_tokens, not by the model
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"


def test_message_list_input_follows_the_instructions_as_a_system_message(client, http):
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "How are you?"}]},
    ]
    response = create(client, input=conversation, instructions="Be brief.")
    expected = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "How are you?"},
    ]
    assert response.usage.input_tokens == prompt_tokens(http, expected)
    assert response.instructions == "Be brief."


def test_sampling_extras_of_vllm_reach_the_sampler(http):
    body = {
        "model": MODEL,
        "input": "Hello",
        "max_output_tokens": 6,
        "temperature": 1.0,
        "seed": 7,
        "top_k": 1,
    }
    top_1 = http.post("/v1/responses", json=body).json()
    greedy = http.post("/v1/responses", json={**body, "temperature": 0, "top_k": None}).json()
    # top_k=1 is greedy whatever the temperature
    assert top_1["output"][0]["content"][0]["text"] == greedy["output"][0]["content"][0]["text"]
    assert top_1["temperature"] == 1.0


# --- the store: previous_response_id, GET, DELETE ---


def test_previous_response_id_continues_the_stored_conversation(client, http):
    first = create(client, input="Hi", instructions="Be brief.")
    assert first.output_text, "the model must say something for the test to see it in the next prompt"
    second = create(client, input="And then?", previous_response_id=first.id)
    # the earlier exchange is in the prompt; the earlier instructions are not (OpenAI's rule)
    expected = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    assert second.usage.input_tokens == prompt_tokens(http, expected)
    assert second.previous_response_id == first.id
    third = create(client, input="Go on.", previous_response_id=second.id)
    expected += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Go on."}]
    assert third.usage.input_tokens == prompt_tokens(http, expected)


def test_a_stored_response_can_be_read_back_and_deleted(client, http):
    response = create(client, input="Hello")
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    assert http.delete(f"/v1/responses/{response.id}").json()["deleted"] is True
    gone = http.get(f"/v1/responses/{response.id}")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"


def test_store_false_keeps_nothing_so_it_cannot_be_continued(client, http):
    response = create(client, input="Hello", store=False)
    assert http.get(f"/v1/responses/{response.id}").status_code == 404
    continued = http.post(
        "/v1/responses", json={"model": MODEL, "input": "More", "previous_response_id": response.id}
    )
    assert continued.status_code == 404, continued.text
    assert continued.json()["error"]["param"] == "previous_response_id"


def test_the_server_keeps_only_the_last_max_stored_responses(client, http):
    oldest = create(client, input="first", max_output_tokens=1)
    later = [create(client, input=f"number {i}", max_output_tokens=1) for i in range(STORED)]
    assert http.get(f"/v1/responses/{oldest.id}").status_code == 404
    assert all(http.get(f"/v1/responses/{r.id}").status_code == 200 for r in later)


def test_response_store_forgets_the_least_recently_used_first():
    store = ResponseStore(max_size=2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}, []))
    assert store.get("a") is not None  # a is now more recent than b
    store.put("c", StoredResponse({"id": "c"}, []))
    assert "b" not in store and "a" in store and "c" in store and len(store) == 2
    assert store.delete("a") and not store.delete("a")
    nothing = ResponseStore(max_size=0)
    nothing.put("a", StoredResponse({}, []))
    assert len(nothing) == 0
    with pytest.raises(ValueError, match="max_stored_responses"):
        ResponseStore(max_size=-1)


def test_max_stored_responses_flag_defaults_to_a_bound():
    import argparse

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert parser.parse_args([]).max_stored_responses == 1024
    assert parser.parse_args(["--max-stored-responses", "3"]).max_stored_responses == 3


# --- structured output and function tools ---


def test_json_schema_text_format_gives_text_valid_against_the_schema(client):
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    text = {"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}}
    response = create(client, input="Weather?", text=text, max_output_tokens=48)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


def test_a_forced_function_tool_answers_with_a_function_call_item(client):
    response = create(
        client,
        input="Weather in Paris?",
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=32,
    )
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_TOOL["parameters"])
    assert response.tool_choice.name == "get_weather"


def test_a_forced_call_wins_over_text_format_which_shapes_only_text_answers(client):
    # The Agents SDK sends both on a tool turn of an agent with an output type.
    text = {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}}
    response = create(
        client,
        input="Weather in Paris?",
        tools=[WEATHER_TOOL],
        tool_choice="required",
        text=text,
        max_output_tokens=32,
    )
    assert [item.type for item in response.output] == ["function_call"]


def test_function_call_output_items_become_the_tool_messages_of_the_prompt(client, http):
    arguments = '{"city": "Paris"}'
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    response = create(client, input=conversation, tools=[WEATHER_TOOL], tool_choice="none")
    assert [item.type for item in response.output] == ["message"]
    as_chat = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}
    chat = http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": as_chat,
            "tools": [chat_tool],
            "tool_choice": "none",
            "max_tokens": 1,
        },
    )
    assert response.usage.input_tokens == chat.json()["usage"]["prompt_tokens"]


# --- streaming ---


def event_types(events) -> list[str]:
    return [event.type for event in events]


def test_a_stream_sends_openais_events_in_order_and_the_client_parses_them(client):
    events = list(
        client.responses.create(
            model=MODEL, input="Hello there", max_output_tokens=8, temperature=0, stream=True
        )
    )
    types = event_types(events)
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text == events[-4].text
    assert final.usage.total_tokens == final.usage.input_tokens + final.usage.output_tokens
    assert text == create(client, input="Hello there").output_text  # streamed or whole, the same reply
    assert client.responses.retrieve(final.id).output_text == text  # a streamed response is stored too


def test_the_clients_stream_helper_assembles_a_streamed_function_call(client):
    with client.responses.stream(
        model=MODEL,
        input="Weather in Paris?",
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=32,
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = event_types(events)
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(types[3:-3]) == {"response.function_call_arguments.delta"}
    (call,) = final.output
    arguments = "".join(
        event.delta for event in events if event.type == "response.function_call_arguments.delta"
    )
    assert call.type == "function_call" and call.name == "get_weather" and call.arguments == arguments
    jsonschema.validate(json.loads(arguments), WEATHER_TOOL["parameters"])


def test_reasoning_is_a_reasoning_item_whole_and_streamed(engine):
    # deepseek_r1's template opens the <think> block, so a reply with no </think> is all reasoning; sampled, as
    # the tiny model's greedy reply is blank lines (which make no reasoning).
    sampled = dict(input="Hello there", max_output_tokens=8, temperature=1.0, extra_body={"seed": 0})
    app = build_app(engine, MODEL, reasoning_parser="deepseek_r1")
    with serve_in_thread(app) as running:
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)
        whole = create(client, **sampled)
        events = list(create(client, **sampled, stream=True))
    (item,) = whole.output
    assert item.type == "reasoning" and item.content[0].type == "reasoning_text" and item.content[0].text
    assert 1 <= whole.usage.output_tokens_details.reasoning_tokens <= whole.usage.output_tokens
    types = event_types(events)
    deltas = types.count("response.reasoning_text.delta")
    assert types[2:] == [
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * deltas,
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    text = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    assert events[-1].response.output[0].content[0].text == text


def test_every_streamed_event_is_one_of_openais_event_types(http):
    body = {"model": MODEL, "input": "Hello", "max_output_tokens": 4, "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    names, payloads = lines[0::2], lines[1::2]
    adapter = TypeAdapter(ResponseStreamEvent)
    for name, payload in zip(names, payloads, strict=True):
        event = adapter.validate_json(payload.removeprefix("data: "))  # strict: every required field present
        assert name == f"event: {event.type}"
    assert event.type == "response.completed"


# --- what is refused ---


REFUSALS = {
    "background": ({"background": True}, "background", ["background"]),
    "hosted_tool": ({"tools": [{"type": "web_search"}]}, "tools[0].type", ["web_search"]),
    "image_input": (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
        "input[0].content[0].type",
        ["input_image"],
    ),
    "unknown_item": (
        {"input": [{"type": "item_reference", "id": "msg_1"}]},
        "input[0].type",
        ["item_reference"],
    ),
    "zero_max_output_tokens": ({"max_output_tokens": 0}, "max_output_tokens", []),
    "max_output_tokens_past_the_context": (
        {"max_output_tokens": 100000},
        "max_output_tokens",
        ["max_output_tokens"],
    ),
    "schema_that_does_not_compile": (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "frob"}}}},
        "text.format",
        ["frob"],
    ),
    "tool_choice_of_an_unknown_function": (
        {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}},
        "tool_choice",
        ["nope"],
    ),
    "include": ({"include": ["message.output_text.logprobs"]}, "include[0]", ["logprobs"]),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_bad_input_is_a_400_naming_the_field(http, case):
    fields, param, words = REFUSALS[case]
    response = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", **fields})
    assert_400(response, param, *words)


def test_unknown_fields_are_ignored_and_named_in_a_header(http):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "frobnicate": 1, "service_tier": "auto"}
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    assert "frobnicate" in response.headers["x-jpaged-ignored-fields"]
