"""Whatever a client sends, the server answers 200 or a 4xx in OpenAI's error shape, never a 5xx, and leaves no
request running and no KV block held: hand-picked odd values per field, and schemathesis's cases generated from the
server's own OpenAPI schema (every operation, valid and invalid bodies)."""

from __future__ import annotations

import collections
import json

import httpx
import pytest
import schemathesis
from figures import record
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jpaged_server.api_server import build_app
from schemathesis import GenerationMode
from server_harness import serve_in_thread, shared_engine, small_config

ODD = [
    None,
    True,
    -1,
    0,
    1,
    2,
    7,
    2**31,
    2**63,
    -(2**63),
    0.5,
    -0.5,
    1e308,
    -1e308,
    "",
    "x",
    [],
    [1],
    {},
    {"a": 1},
]
FIELDS = {
    "max_tokens": ODD,
    "temperature": ODD,
    "top_p": ODD,
    "top_k": ODD,
    "min_p": ODD,
    "n": ODD,
    "seed": ODD,
    "stop": [*ODD, ["", "a"], ["a"] * 10],
    "stop_token_ids": [*ODD, [0, 1, 2], [-5]],
    "presence_penalty": ODD,
    "frequency_penalty": ODD,
    "repetition_penalty": ODD,
    "logit_bias": [*ODD, {"1": 100}, {"1": -1e308}, {"-1": 1}],
    "min_tokens": ODD,
    "ignore_eos": ODD,
    "skip_special_tokens": ODD,
    "include_stop_str_in_output": ODD,
    "priority": ODD,
    "stream_options": [*ODD, {"include_usage": True}],
}
COMPLETION_FIELDS = {
    **FIELDS,
    "prompt": [*ODD, [[1, 2], [3]], [[]], ["a", "b"], [0] * 300],
    "echo": ODD,
    "logprobs": ODD,
    "use_beam_search": ODD,
    "length_penalty": ODD,
}
CHAT_FIELDS = {
    **FIELDS,
    "messages": [
        *ODD,
        [{"role": "user", "content": ""}],
        [{"role": "assistant", "content": None}],
        [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        [{"role": "system", "content": "x"}, {"role": "system", "content": "y"}],
    ],
    "logprobs": ODD,
    "top_logprobs": ODD,
    "max_completion_tokens": ODD,
    "add_generation_prompt": ODD,
    "chat_template_kwargs": [*ODD, {"enable_thinking": True}],
}


def bodies(base: dict, fields: dict) -> st.SearchStrategy[dict]:
    """`base` with up to four of `fields` set to one of their listed values, streamed or not."""
    chosen = st.dictionaries(st.sampled_from(sorted(fields)), st.integers(0, 10**6), max_size=4)
    return st.builds(
        lambda picks, stream: {
            **base,
            **{name: fields[name][i % len(fields[name])] for name, i in picks.items()},
            "stream": stream,
        },
        chosen,
        st.booleans(),
    )


def check_answer(http: httpx.Client, path: str, body: dict) -> None:
    content = json.dumps(body, allow_nan=False)
    with http.stream("POST", path, content=content, headers={"Content-Type": "application/json"}) as response:
        text = response.read().decode()
    assert response.status_code < 500, (body, text)
    if response.status_code >= 400:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"}, (body, text)
    elif body["stream"]:
        assert text.rstrip().endswith("data: [DONE]"), (body, text)
        assert '"error"' not in text, (body, text)


def assert_nothing_held(engine) -> None:
    metrics = engine.metrics()  # free blocks include cached ones nobody holds
    assert metrics["num_requests_running"] == metrics["num_requests_waiting"] == 0
    assert metrics["num_free_blocks"] == metrics["num_total_blocks"]


FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@FUZZ
@given(body=bodies({"prompt": "Hi", "max_tokens": 3}, COMPLETION_FIELDS))
def test_any_completion_body_gets_200_or_a_4xx_and_holds_nothing(http, engine, body):
    check_answer(http, "/v1/completions", body)
    assert_nothing_held(engine)


@FUZZ
@given(body=bodies({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}, CHAT_FIELDS))
def test_any_chat_body_gets_200_or_a_4xx_and_holds_nothing(http, engine, body):
    check_answer(http, "/v1/chat/completions", body)
    assert_nothing_held(engine)


# schemathesis: cases from the schema the server serves at /openapi.json, for every operation in it. A context of 64
# tokens keeps each generated request to a few dozen steps of the tiny model (generated text prompts are mostly
# longer: 400s), so a few hundred cases take about a minute on two cores.
# A GET or DELETE of one path parameter needs few cases: an id that is not there is all there is to try.
EXAMPLES_PER_OPERATION = {"POST": 130, "GET": 5, "DELETE": 5}
MIN_CASES = 500


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir):
    engine = shared_engine(small_config(tiny_model_dir, max_model_len=64))
    with serve_in_thread(build_app(engine, "tiny")) as running:
        yield running, engine


def check_schemathesis_answer(case, response) -> None:
    label = f"{case.method} {case.path} {case.body!r:.500}"
    assert response.status_code < 500, (label, response.text[:500])
    if response.status_code >= 400:
        error = json.loads(response.text)["error"]
        assert set(error) == {"message", "type", "param", "code"}, (label, response.text[:500])
        assert error["code"] == response.status_code, (label, response.text[:500])


def fuzz(operation, mode: GenerationMode, examples: int, base_url: str, counts: collections.Counter) -> None:
    """`examples` cases of one operation, each sent to the live server and checked; statuses counted."""

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(mode))
    def run(case) -> None:
        response = case.call(base_url=base_url, timeout=60)  # a hang fails the case
        counts[response.status_code] += 1
        check_schemathesis_answer(case, response)

    run()


def test_schemathesis_cases_from_the_servers_own_schema_get_no_5xx(fuzz_server):
    running, engine = fuzz_server
    schema = schemathesis.openapi.from_url(f"{running.base_url}/openapi.json")
    statuses: dict[str, collections.Counter] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        method = operation.method.upper()
        name = f"{method} {operation.path}"
        counts = statuses[name] = collections.Counter()
        modes = [GenerationMode.POSITIVE]
        if operation.body:  # a negative case needs something to break: an operation without inputs has none
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            fuzz(operation, mode, EXAMPLES_PER_OPERATION[method] // len(modes), running.base_url, counts)
        assert_nothing_held(engine)
    total = sum(sum(c.values()) for c in statuses.values())
    server_errors = sum(n for c in statuses.values() for status, n in c.items() if status >= 500)
    record(
        "schemathesis fuzzing (tests/test_server_fuzz.py)",
        "\n".join(
            [f"{total} cases, {server_errors} 5xx, {len(statuses)} operations"]
            + [f"{name}: {dict(sorted(c.items()))}" for name, c in statuses.items()]
        ),
    )
    fuzzed = {
        "POST /v1/completions",
        "POST /v1/chat/completions",
        "POST /v1/responses",
        "POST /v1/embeddings",
    }
    assert fuzzed | {"POST /tokenize", "POST /detokenize"} <= set(statuses)
    assert all(sum(c.values()) for c in statuses.values()), statuses
    assert total >= MIN_CASES, statuses
