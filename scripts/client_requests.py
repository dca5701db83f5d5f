"""The exact request bodies the pinned third-party clients send: the calls of tests/test_third_party_clients.py
made against a live server (--url) with an httpx hook that records each request, as table entries named client_*.

Used by `scripts/vllm_request_statuses.py --capture-clients`, which replaces the table's client_* entries with
these before it measures; alone it prints them:

    python scripts/client_requests.py --url http://127.0.0.1:8000

What the server answers does not matter here (a client that fails to parse a reply has still sent its request),
only what each client sent; multi-turn clients (the Agents SDK) send their later turns only if the earlier ones
succeeded.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import test_third_party_clients as calls  # noqa: E402

MODEL = calls.MODEL


class Recorder:
    """An httpx request hook that files each request under the call now running."""

    def __init__(self) -> None:
        self.call: tuple[str, str] | None = None
        self.requests: list[tuple[str, str, httpx.Request]] = []

    def __call__(self, request: httpx.Request) -> None:
        self.requests.append((*self.call, request))

    async def async_hook(self, request: httpx.Request) -> None:
        self(request)

    def async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(event_hooks={"request": [self.async_hook]}, timeout=120)

    def client(self, url: str) -> openai.OpenAI:
        http = httpx.Client(event_hooks={"request": [self]}, timeout=120)
        return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, http_client=http)


def client_calls(url: str, recorder: Recorder) -> list[tuple[str, str, Callable[[], object]]]:
    """(entry name, source, call) for every shape tests/test_third_party_clients.py sends."""
    import instructor
    from langchain_openai import ChatOpenAI

    v = {p: version(p) for p in ("openai", "langchain-openai", "instructor", "openai-agents")}
    agents = f"openai-agents {v['openai-agents']} Runner.run, OpenAIResponsesModel,"
    sdk, lc, ins = (
        f"openai {v['openai']}",
        f"langchain-openai {v['langchain-openai']}",
        f"instructor {v['instructor']}",
    )
    chat_model = ChatOpenAI(
        model=MODEL,
        base_url=url,
        api_key="unused",
        max_tokens=calls.MAX_TOKENS,
        temperature=0,
        max_retries=0,
        http_client=httpx.Client(event_hooks={"request": [recorder]}, timeout=120),
    )
    found = [
        (
            "client_openai_parse_response_format",
            f"{sdk} client.chat.completions.parse(response_format=PydanticModel)",
            lambda: calls.test_openai_parse_with_a_pydantic_response_format(recorder.client(url)),
        ),
        (
            "client_openai_parse_pydantic_function_tool",
            f"{sdk} parse(tools=[openai.pydantic_function_tool(M)], named tool_choice)",
            lambda: calls.test_openai_parse_with_pydantic_function_tool(recorder.client(url)),
        ),
        (
            "client_openai_stream_helper_response_format",
            f"{sdk} client.chat.completions.stream(response_format=PydanticModel)",
            lambda: calls.test_openai_stream_helper_with_a_response_format(recorder.client(url)),
        ),
        (
            "client_openai_stream_helper_strict_tool",
            f"{sdk} client.chat.completions.stream(tools=[pydantic_function_tool], tool_choice='required')",
            lambda: calls.test_openai_stream_helper_with_a_strict_tool(recorder.client(url)),
        ),
    ]
    tool_choices = {
        "tool_name": "GetWeather",
        "any": "any",
        "auto": "auto",
        "dict": {"type": "function", "function": {"name": "GetWeather"}},
    }
    for tag, choice in tool_choices.items():
        found.append(
            (
                f"client_langchain_bind_tools_{tag}",
                f"{lc} ChatOpenAI.bind_tools([M], tool_choice={choice!r})",
                lambda choice=choice: chat_model.bind_tools([calls.GetWeather], tool_choice=choice).invoke(
                    calls.ASK
                ),
            )
        )
    for method in ("json_schema", "function_calling", "json_mode"):
        found.append(
            (
                f"client_langchain_structured_{method}",
                f"{lc} ChatOpenAI.with_structured_output(M, method={method!r})",
                lambda method=method: chat_model.with_structured_output(calls.Weather, method=method).invoke(
                    calls.ASK
                ),
            )
        )
    ask = dict(model=MODEL, messages=calls.ASK, response_model=calls.Weather, max_tokens=calls.MAX_TOKENS)
    ask.update(temperature=0, max_retries=0)

    def completions(mode: str):
        return instructor.from_openai(
            recorder.client(url), mode=getattr(instructor.Mode, mode)
        ).chat.completions

    found += [
        (
            "client_instructor_tools",
            f"{ins} Mode.TOOLS create(response_model=M)",
            lambda: completions("TOOLS").create(**ask),
        ),
        (
            "client_instructor_tools_strict",
            f"{ins} Mode.TOOLS_STRICT create(response_model=M, strict=True)",
            lambda: completions("TOOLS_STRICT").create(**ask, strict=True),
        ),
        (
            "client_instructor_json_schema",
            f"{ins} Mode.JSON_SCHEMA create(response_model=M)",
            lambda: completions("JSON_SCHEMA").create(**ask),
        ),
        (
            "client_instructor_create_partial",
            f"{ins} Mode.TOOLS create_partial",
            lambda: list(completions("TOOLS").create_partial(**ask)),
        ),
        (
            "client_instructor_create_iterable",
            f"{ins} Mode.TOOLS create_iterable",
            lambda: list(completions("TOOLS").create_iterable(**{**ask, "messages": calls.ASK_MANY})),
        ),
        (
            "client_agents_sdk_turn",
            f"{agents} one function tool (turn by turn)",
            lambda: calls.run_weather_agent(url, recorder.async_client()),
        ),
        (
            "client_agents_sdk_output_type_turn",
            f"{agents} one function tool, output_type=M (turn by turn)",
            lambda: calls.run_weather_agent(url, recorder.async_client(), output_type=calls.Weather),
        ),
    ]
    return found


def with_placeholder(value):
    """The body with the served model's name replaced by the table's "$MODEL"."""
    if value == MODEL:
        return "$MODEL"
    if isinstance(value, dict):
        return {k: with_placeholder(v) for k, v in value.items()}
    if isinstance(value, list):
        return [with_placeholder(v) for v in value]
    return value


def capture(url: str) -> list[dict]:
    """Table entries (name, method, path, body, source) for every request the clients sent to `url`/v1."""
    recorder = Recorder()
    for name, source, call in client_calls(f"{url}/v1", recorder):
        recorder.call = (name, source)
        try:
            call()
        except Exception as error:  # a reply the client could not use: its request is recorded all the same
            print(
                f"{name}: the client raised {type(error).__name__} (its request is recorded)", file=sys.stderr
            )
    entries, turns = [], {}
    for name, source, request in recorder.requests:
        turns[name] = turns.get(name, 0) + 1
        turn = turns[name]
        entries.append(
            {
                "name": name if turn == 1 else f"{name}_{turn}",
                "method": request.method,
                "path": request.url.path,
                "body": with_placeholder(json.loads(request.content)) if request.content else None,
                "source": source if turn == 1 else f"{source}, request {turn}",
            }
        )
    return entries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--url", required=True, help="a live OpenAI-compatible server serving the model as 'tiny'"
    )
    args = ap.parse_args()
    for entry in capture(args.url):
        print(json.dumps(entry))


if __name__ == "__main__":
    main()
