"""Real third-party clients, unchanged, against a jpaged server built as `jpaged serve --enable-auto-tool-choice
--tool-call-parser hermes` builds it: the official `openai` SDK's strict helpers, LangChain's ChatOpenAI, instructor,
the OpenAI Agents SDK, and the request shapes guidellm and `vllm bench serve` send (tests/data's table).

The model is the tiny random one: what it says is noise, but structured outputs and forced tool calls are
grammar-constrained, so they parse into the clients' pydantic models whatever the model. Where a client's result
depends on what the model chooses (tool_choice "auto", json_mode's unconstrained object, an agent's free-text
answer), the test asserts what the server guarantees and says what it leaves to the model. The schemas use enums and booleans so every constrained
reply ends within max_tokens.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Literal

import agents
import httpx
import instructor
import openai
import pytest
from jpaged_server.api_server import build_app
from langchain_openai import ChatOpenAI
from pydantic import BaseModel
from server_harness import serve_in_thread

TABLE = Path(__file__).parent / "data" / "vllm_request_statuses.json"
MODEL = "tiny"
MAX_TOKENS = 64  # every constrained reply below fits: enums, booleans, no free strings or numbers
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ASK_MANY = [{"role": "user", "content": "Tell me the weather in every city."}]
TABLE_NAMES = {
    "guidellm, chat": "chat_guidellm_stream",
    "guidellm, completions": "completions_guidellm_stream",
    "vllm bench serve, openai-chat": "chat_vllm_bench_serve",
    "vllm bench serve, openai-chat --ignore-eos": "chat_vllm_bench_serve_ignore_eos_greedy",
    "vllm bench serve, openai": "completions_vllm_bench_serve",
    "vllm bench serve, openai --ignore-eos": "completions_vllm_bench_serve_ignore_eos",
}


class Weather(BaseModel):
    city: Literal["Paris", "Tokyo"]
    sunny: bool


class GetWeather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Tokyo"]


@pytest.fixture(scope="module")
def base_url(engine):
    app = build_app(engine, MODEL, auto_tool_parser="hermes")
    with serve_in_thread(app) as running:
        yield f"{running.base_url}/v1"


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


# --- the openai SDK's strict helpers ---


def test_openai_parse_with_a_pydantic_response_format(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=ASK, response_format=Weather, max_tokens=MAX_TOKENS, temperature=0
    )
    assert isinstance(completion.choices[0].message.parsed, Weather)


def test_openai_parse_with_pydantic_function_tool(client):
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=ASK,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    (call,) = completion.choices[0].message.tool_calls
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_openai_stream_helper_with_a_response_format(client):
    with client.chat.completions.stream(
        model=MODEL, messages=ASK, response_format=Weather, max_tokens=MAX_TOKENS, temperature=0
    ) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion()
    assert {"content.delta", "content.done"} <= kinds
    assert isinstance(final.choices[0].message.parsed, Weather)


def test_openai_stream_helper_with_a_strict_tool(client):
    with client.chat.completions.stream(
        model=MODEL,
        messages=ASK,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required",
        max_tokens=MAX_TOKENS,
        temperature=0,
    ) as stream:
        done = [event for event in stream if event.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert [event.name for event in done] == ["GetWeather"]
    assert isinstance(done[0].parsed_arguments, GetWeather)
    assert isinstance(final.choices[0].message.tool_calls[0].function.parsed_arguments, GetWeather)


# --- LangChain ---


@pytest.fixture(scope="module")
def chat_model(base_url):
    return ChatOpenAI(
        model=MODEL, base_url=base_url, api_key="unused", max_tokens=MAX_TOKENS, temperature=0, max_retries=0
    )


@pytest.mark.parametrize(
    "tool_choice",
    ["GetWeather", "any", "required", {"type": "function", "function": {"name": "GetWeather"}}],
    ids=["tool-name", "any", "required", "dict"],
)
def test_langchain_bind_tools_with_a_forced_tool_choice_calls_the_tool(chat_model, tool_choice):
    message = chat_model.bind_tools([GetWeather], tool_choice=tool_choice).invoke(ASK)
    (call,) = message.tool_calls
    assert call["name"] == "GetWeather"
    assert GetWeather.model_validate(call["args"])


def test_langchain_bind_tools_auto_leaves_the_choice_to_the_model(chat_model):
    message = chat_model.bind_tools([GetWeather], tool_choice="auto").invoke(ASK)
    # Whether the random model calls the tool is its own choice; what the server owes is a well-formed reply:
    # text, or calls that name the declared tool with arguments LangChain could parse.
    assert isinstance(message.content, str)
    assert not message.invalid_tool_calls
    assert all(call["name"] == "GetWeather" for call in message.tool_calls)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_parses_into_the_model(chat_model, method):
    assert isinstance(chat_model.with_structured_output(Weather, method=method).invoke(ASK), Weather)


def test_langchain_with_structured_output_json_mode_asks_for_a_json_object(chat_model):
    # json_mode sends response_format {"type": "json_object"} and no schema: the server constrains the reply to a
    # JSON object, its contents are the model's. The tiny random model, greedy, never closes the object's first
    # string (it repeats one token), so the reply stops at max_tokens and the openai SDK's parse helper, which
    # LangChain calls, raises: the model's failure, not the server's (any length limit cuts it the same way).
    with pytest.raises(openai.LengthFinishReasonError) as raised:
        chat_model.with_structured_output(Weather, method="json_mode").invoke(ASK)
    assert raised.value.completion.choices[0].message.content.startswith('{"')  # the object under way


# --- instructor ---


@pytest.mark.filterwarnings("ignore:Mode.TOOLS_STRICT is deprecated")
@pytest.mark.parametrize(
    "mode, options",
    # instructor 1.17 folds TOOLS_STRICT into TOOLS and asks for a strict tool schema with strict=True
    [("TOOLS", {}), ("TOOLS_STRICT", {"strict": True}), ("JSON_SCHEMA", {})],
    ids=["TOOLS", "TOOLS_STRICT", "JSON_SCHEMA"],
)
def test_instructor_modes_return_the_response_model(client, mode, options):
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    weather = patched.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_model=Weather,
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
        **options,
    )
    assert isinstance(weather, Weather)


def test_instructor_create_partial_streams_to_a_whole_model(client):
    patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    partials = list(
        patched.chat.completions.create_partial(
            model=MODEL,
            messages=ASK,
            response_model=Weather,
            max_tokens=MAX_TOKENS,
            temperature=0,
            max_retries=0,
        )
    )
    assert partials
    assert Weather.model_validate(partials[-1].model_dump())


def test_instructor_create_iterable_streams_whole_models(client):
    patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    # How long the list is is the model's choice (the grammar allows any length): to most prompts the tiny random
    # model, greedy, answers {"tasks": []}; to this one it starts a list that max_tokens cuts. instructor yields
    # each object as it closes in the streamed arguments.
    items = patched.chat.completions.create_iterable(
        model=MODEL,
        messages=ASK_MANY,
        response_model=Weather,
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
    )
    items = list(items)
    assert items and all(isinstance(item, Weather) for item in items)


# --- the OpenAI Agents SDK ---


def run_weather_agent(base_url: str, http_client: httpx.AsyncClient | None = None, **agent_options):
    """Runner.run on an Agent with the default model class (OpenAIResponsesModel) and one function tool; the first
    turn is made to call the tool (the grammar makes the random model do it); the SDK then resets the choice to
    "auto" for the turn that answers. Returns (the run's result or the exception it raised, the tool's calls)."""
    agents.set_tracing_disabled(True)  # the tracer would post to api.openai.com
    calls = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Tokyo"]) -> str:  # an enum: a free string would never end
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    async def run():
        options = dict(base_url=base_url, api_key="unused", max_retries=0, http_client=http_client)
        async with openai.AsyncOpenAI(**options) as client:
            agent = agents.Agent(
                name="weather",
                instructions="Answer with the weather.",
                tools=[get_weather],
                model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
                model_settings=agents.ModelSettings(
                    tool_choice="get_weather", max_tokens=MAX_TOKENS, temperature=0
                ),
                **agent_options,
            )
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3)

    try:
        return asyncio.run(run()), calls
    except Exception as error:
        return error, calls


def test_agents_sdk_runs_a_function_tool_then_answers_in_its_output_type(base_url):
    result, calls = run_weather_agent(base_url, output_type=Weather)
    assert len(calls) == 1  # turn 1: the forced call ran; its output went back in turn 2's input
    assert isinstance(result.final_output, Weather)  # turn 2: text.format json_schema, grammar-constrained


def test_agents_sdk_free_text_answer_is_the_models_to_end(base_url):
    result, calls = run_weather_agent(base_url)
    assert len(calls) == 1
    # The second turn answers in free text, which the tiny random model never ends (it has no EOS in it): the
    # response stops at max_output_tokens as status "incomplete", and the SDK refuses an incomplete response.
    # The model's failure, not the server's: a model that ends its text gets a str final_output (checked against
    # vLLM serving SmolLM2-135M).
    assert isinstance(result, agents.exceptions.ModelBehaviorError), result
    assert "max_output_tokens" in str(result)


# --- guidellm's and `vllm bench serve`'s request shapes ---


def table_body(name: str) -> tuple[dict, str]:
    (entry,) = [entry for entry in json.loads(TABLE.read_text())["entries"] if entry["name"] == name]
    return {**entry["body"], "model": MODEL}, entry["path"]


def read_stream(base_url: str, path: str, body: dict) -> list[dict]:
    """Every chunk of a streamed reply, read as the benchmark clients read it, to [DONE]."""
    chunks = []
    with (
        httpx.Client(timeout=120) as http,
        http.stream("POST", base_url.removesuffix("/v1") + path, json=body) as response,
    ):
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                return chunks
            chunks.append(json.loads(data))
    raise AssertionError("the stream closed without [DONE]")


@pytest.mark.parametrize("tool", list(TABLE_NAMES))
def test_benchmark_clients_streams_carry_text_and_usage(base_url, tool):
    body, path = table_body(TABLE_NAMES[tool])
    chunks = read_stream(base_url, path, body)
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    *content, last = chunks
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] > 0  # include_usage's final chunk
    completion_tokens = last["usage"]["completion_tokens"]
    if body.get("ignore_eos"):
        assert completion_tokens == limit
    assert 1 <= completion_tokens <= limit
    assert any(
        choice.get("text") or choice.get("delta", {}).get("content")
        for c in content
        for choice in c["choices"]
    )
    if body["stream_options"].get("continuous_usage_stats"):
        # guidellm reads usage from every chunk: each carries the running count
        counts = [c["usage"]["completion_tokens"] for c in content if c["choices"]]
        assert counts == sorted(counts) and counts[-1] == completion_tokens
