"""Hostile input: absurd sizes, broken encodings, deep nesting, NaN, ids outside the vocabulary, thousands of stop
strings. Each is a 400 in OpenAI's error shape naming the field where one is at fault; none crashes, hangs or holds
a KV block, and the server serves the next request as before."""

from __future__ import annotations

import httpx
import pytest
from jpaged_server.protocol import MAX_STOP_STRINGS

HI = [{"role": "user", "content": "Hi"}]
VOCAB = 49152  # the tiny models' vocabulary (tests/conftest.py)


def assert_error(response: httpx.Response, status: int, param: str | None, *words: str) -> None:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, error
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]


def assert_nothing_held(engine) -> None:
    metrics = engine.metrics()
    assert metrics["num_requests_running"] == metrics["num_requests_waiting"] == 0
    assert metrics["num_free_blocks"] == metrics["num_total_blocks"]
    assert engine.is_alive


def raw(http: httpx.Client, path: str, content: bytes | str) -> httpx.Response:
    return http.post(path, content=content, headers={"Content-Type": "application/json"})


COMPLETION_CASES = {
    "huge_n": ({"prompt": "x", "n": 10**9}, "n", "max_num_seqs"),
    "huge_max_tokens": ({"prompt": "x", "max_tokens": 10**18}, "max_tokens", "max_model_len"),
    "huge_logprobs": ({"prompt": "x", "logprobs": 10**9}, "logprobs", "logprobs"),
    "huge_beam_width": ({"prompt": "x", "use_beam_search": True, "n": 10**9}, "n", "beam width"),
    "negative_token_id": ({"prompt": [1, -1]}, "prompt", "vocabulary"),
    "token_id_past_int64": ({"prompt": [2**70]}, "prompt", "vocabulary"),
    "echoed_token_id_outside_vocab": ({"prompt": [-1], "echo": True}, "prompt", "vocabulary"),
    "stop_token_id_outside_vocab": (
        {"prompt": "x", "stop_token_ids": [VOCAB]},
        "stop_token_ids",
        "vocabulary",
    ),
    "logit_bias_id_outside_vocab": (
        {"prompt": "x", "logit_bias": {str(10**30): 1}},
        "logit_bias",
        "vocabulary",
    ),
    "empty_prompt": ({"prompt": ""}, "prompt", "empty"),
    "empty_prompt_list": ({"prompt": []}, "prompt", "empty"),
    "empty_token_list_in_a_batch": ({"prompt": [[1, 2], []]}, "prompt", "empty"),
    "empty_string_in_a_batch": ({"prompt": ["a", ""]}, "prompt", "empty"),
    "ten_thousand_stop_strings": (
        {"prompt": "x", "stop": [f"stop{i}" for i in range(10_000)]},
        "stop",
        str(MAX_STOP_STRINGS),
    ),
    "full_vocabulary_logit_bias": (
        {"prompt": "x", "logit_bias": {str(t): 1.0 for t in range(VOCAB)}},
        "logit_bias",
        "logit_bias",
    ),
}


@pytest.mark.parametrize("case", COMPLETION_CASES.values(), ids=COMPLETION_CASES.keys())
def test_hostile_completion_is_400_naming_the_field(http, engine, case):
    body, param, *words = case
    assert_error(http.post("/v1/completions", json=body), 400, param, *words)
    assert_nothing_held(engine)


CHAT_CASES = {
    "no_messages": ({"messages": []}, "messages", "messages"),
    "unknown_role": ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "role"),
    "role_in_capitals": ({"messages": [{"role": "User", "content": "x"}]}, "messages.0.role", "role"),
    "empty_role": ({"messages": [{"role": "", "content": "x"}]}, "messages.0.role", "role"),
    "huge_top_logprobs": ({"messages": HI, "logprobs": True, "top_logprobs": 10**9}, "top_logprobs", "20"),
    "huge_max_completion_tokens": (
        {"messages": HI, "max_completion_tokens": 10**18},
        "max_completion_tokens",
        "max_model_len",
    ),
    "huge_n": ({"messages": HI, "n": 10**9}, "n", "max_num_seqs"),
}


@pytest.mark.parametrize("case", CHAT_CASES.values(), ids=CHAT_CASES.keys())
def test_hostile_chat_is_400_naming_the_field(http, engine, case):
    body, param, *words = case
    assert_error(http.post("/v1/chat/completions", json=body), 400, param, *words)
    assert_nothing_held(engine)


# Python's json reads NaN, Infinity and -Infinity (and 1e400 as infinity): no client means them as a number.
NON_FINITE = {
    "temperature_nan": ('{"prompt": "x", "temperature": NaN}', "temperature"),
    "top_p_infinity": ('{"prompt": "x", "top_p": Infinity}', "top_p"),
    "presence_penalty_minus_infinity": ('{"prompt": "x", "presence_penalty": -Infinity}', "presence_penalty"),
    "logit_bias_nan": ('{"prompt": "x", "logit_bias": {"1": NaN}}', "logit_bias.1"),
    "length_penalty_overflowing": (
        '{"prompt": "x", "use_beam_search": true, "length_penalty": 1e400}',
        "length_penalty",
    ),
    "max_tokens_infinity": ('{"prompt": "x", "max_tokens": Infinity}', "max_tokens"),
}


@pytest.mark.parametrize("case", NON_FINITE.values(), ids=NON_FINITE.keys())
def test_nan_and_infinity_are_400_naming_the_field(http, engine, case):
    content, param = case
    assert_error(raw(http, "/v1/completions", content), 400, param)
    assert_nothing_held(engine)


def test_invalid_utf8_body_is_400(http, engine):
    assert_error(raw(http, "/v1/completions", b'{"prompt": "caf\xc3 \xff\xfe"}'), 400, None)
    assert_nothing_held(engine)


def test_lone_surrogate_in_a_prompt_is_400(http, engine):
    """JSON may escape half a UTF-16 pair, which is no character: the tokenizer cannot encode it."""
    response = raw(http, "/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}')
    assert_error(response, 400, "prompt", "surrogate")
    assert_nothing_held(engine)


def test_deeply_nested_json_is_400(http, engine):
    depth = 100_000  # far past any recursion limit, well under the body limit
    assert_error(raw(http, "/v1/completions", '{"prompt": ' + "[" * depth + "]" * depth + "}"), 400, None)
    nested_kwargs = (
        '{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": '
        + ('{"a": ' * depth + "1" + "}" * depth)
        + "}}"
    )
    assert_error(raw(http, "/v1/chat/completions", nested_kwargs), 400, None)
    assert_nothing_held(engine)


def test_detokenize_refuses_ids_outside_the_vocabulary(http):
    for tokens in ([-1], [VOCAB], [2**70]):
        assert_error(http.post("/detokenize", json={"tokens": tokens}), 400, "tokens", "vocabulary")


def test_the_server_serves_as_before_after_the_hostile_requests(http, engine):
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    first = http.post("/v1/completions", json=body)
    for content in ('{"prompt": "x", "temperature": NaN}', b"\xff", "[" * 10_000):
        raw(http, "/v1/completions", content)
    again = http.post("/v1/completions", json=body)
    assert first.status_code == again.status_code == 200
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert_nothing_held(engine)
