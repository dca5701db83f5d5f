"""Bad input, auth, unknown models, overload and a dead engine: each gets its status and OpenAI's error body."""

from __future__ import annotations

import httpx
import pytest
from engine_gate import EngineGate, wait_until
from jpaged_server.api_server import build_app
from server_harness import serve_in_thread

MODEL = "tiny-smollm2"
API_KEY = "test-secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(engine):
    # No waiting room: the (max_num_seqs + 1)-th concurrent request is refused, which the overload test needs.
    with serve_in_thread(build_app(engine, MODEL, API_KEY, max_waiting_requests=0)) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as client:
        yield client


def assert_error(response: httpx.Response, status: int, param: str | None = None, *words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]


COMPLETION_CASES = {
    "unsupported_openai_field": ({"prompt": "x", "suffix": "y"}, "suffix", "suffix"),
    "top_p_out_of_range": ({"prompt": "x", "top_p": 5}, "top_p", "top_p"),
    "negative_temperature": ({"prompt": "x", "temperature": -1}, "temperature", "temperature"),
    "zero_samples": ({"prompt": "x", "n": 0}, "n", "n must"),
    "greedy_with_two_samples": ({"prompt": "x", "n": 2, "temperature": 0}, "n", "greedy"),
    "zero_max_tokens": ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens"),
    "too_many_logprobs": ({"prompt": "x", "logprobs": 21}, "logprobs", "logprobs"),
    "prompt_of_wrong_type": ({"prompt": 5}, "prompt", "prompt"),
    "empty_prompt": ({"prompt": ""}, "prompt", "empty"),
    "empty_prompt_list": ({"prompt": []}, "prompt", "empty"),
    "token_id_outside_vocab": ({"prompt": [1, 10**9]}, "prompt", "vocabulary"),
    "stop_token_outside_vocab": (
        {"prompt": "x", "stop_token_ids": [10**9]},
        "stop_token_ids",
        "stop_token_ids",
    ),
    "logit_bias_key_not_an_id": ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias", "logit_bias"),
    "logit_bias_outside_vocab": ({"prompt": "x", "logit_bias": {"999999999": 1}}, "logit_bias", "vocabulary"),
    "beam_search_with_top_p": ({"prompt": "x", "use_beam_search": True, "top_p": 0.5}, "top_p", "beam"),
    "beam_search_too_wide": ({"prompt": "x", "use_beam_search": True, "n": 11}, "n", "beam width"),
    "more_beams_than_max_num_seqs": ({"prompt": "x", "use_beam_search": True, "n": 9}, "n", "max_num_seqs"),
    "more_samples_than_max_num_seqs": ({"prompt": "x", "n": 9}, "n", "max_num_seqs"),
    "stream_options_without_stream": (
        {"prompt": "x", "stream_options": {"include_usage": True}},
        "stream_options",
        "stream",
    ),
    "prompt_longer_than_context": ({"prompt": [1] * 300}, "prompt", "300", "256"),
    "max_tokens_past_context": ({"prompt": [1] * 200, "max_tokens": 100}, "max_tokens", "200", "256"),
}


@pytest.mark.parametrize("case", COMPLETION_CASES.values(), ids=COMPLETION_CASES.keys())
def test_bad_completion_request_is_400_naming_the_field(http, case):
    body, param, *words = case
    assert_error(http.post("/v1/completions", json=body), 400, param, *words)


CHAT_CASES = {
    "no_messages": ({"messages": []}, "messages", "messages"),
    "unknown_role": ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "role"),
    "image_content": (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages.0.content",
        "content",
    ),
    "tools_and_legacy_functions": (
        {"messages": HI, "tools": [], "functions": [{"name": "f"}]},
        "functions",
        "not both",
    ),
    "more_samples_than_max_num_seqs": ({"messages": HI, "n": 9}, "n", "max_num_seqs"),
    "beam_search": ({"messages": HI, "use_beam_search": True}, "use_beam_search", "/v1/completions"),
    "top_logprobs_without_logprobs": ({"messages": HI, "top_logprobs": 2}, "top_logprobs", "logprobs"),
    "too_many_top_logprobs": ({"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "21"),
    "max_completion_tokens_past_context": (
        {"messages": HI, "max_completion_tokens": 1000},
        "max_completion_tokens",
        "256",
    ),
    "reserved_template_kwarg": (
        {"messages": HI, "chat_template_kwargs": {"tokenize": True}},
        "chat_template_kwargs",
    ),
}


@pytest.mark.parametrize("case", CHAT_CASES.values(), ids=CHAT_CASES.keys())
def test_bad_chat_request_is_400_naming_the_field(http, case):
    body, param, *words = case
    assert_error(http.post("/v1/chat/completions", json=body), 400, param, *words)


def test_malformed_json_is_400(http):
    response = http.post(
        "/v1/completions", content=b'{"prompt": ', headers={"Content-Type": "application/json"}
    )
    assert_error(response, 400, None, "JSON")
    assert_error(http.post("/v1/completions", json=["not", "an", "object"]), 400)


def test_missing_or_wrong_api_key_is_401_but_probes_stay_open(server):
    body = {"prompt": "x", "max_tokens": 1}
    assert_error(httpx.post(f"{server.base_url}/v1/completions", json=body), 401)
    wrong = {"Authorization": "Bearer nope"}
    assert_error(httpx.post(f"{server.base_url}/v1/completions", json=body, headers=wrong), 401)
    assert_error(httpx.get(f"{server.base_url}/v1/models"), 401)
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200


class _CountReadBytes:
    """Outermost middleware: the body bytes the server's app actually pulled from the connection."""

    def __init__(self, app, pulled: list[int]) -> None:
        self.app, self.pulled = app, pulled

    async def __call__(self, scope, receive, send):
        async def counted():
            message = await receive()
            self.pulled.append(len(message.get("body", b"")))
            return message

        await self.app(scope, counted, send)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_size_limit_is_413_before_it_is_read_whole(engine, chunked):
    limit, size = 64 << 10, 4 << 20
    body = b'{"prompt": "' + b"x" * size + b'"}'
    content = (body[i : i + (16 << 10)] for i in range(0, len(body), 16 << 10)) if chunked else body
    pulled: list[int] = []
    app = build_app(engine, MODEL, max_request_body_bytes=limit)
    app.add_middleware(_CountReadBytes, pulled=pulled)
    with serve_in_thread(app) as running:
        response = httpx.post(f"{running.base_url}/v1/completions", content=content, timeout=60)
        small = httpx.post(f"{running.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert_error(response, 413, None, f"limit of {limit} bytes")
    assert (
        sum(pulled) < size // 4
    )  # the server stopped reading near the limit (the small request adds ~30 bytes)
    assert small.status_code == 200
    assert engine.num_unfinished == 0


def test_unknown_model_is_404(http):
    assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model", "gpt-9")
    assert_error(http.post("/tokenize", json={"model": "gpt-9", "prompt": "x"}), 404, "model")


def test_unknown_route_is_404_in_the_error_shape(http):
    assert_error(http.get("/v1/nothing-here"), 404)


def test_server_keeps_serving_after_bad_requests(http):
    for _ in range(3):
        assert http.post("/v1/completions", json={"prompt": "x", "top_p": 7}).status_code == 400
    response = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    )
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


def test_past_the_waiting_cap_new_requests_are_503(http, engine):
    capacity = engine.engine.config.max_num_seqs  # max_waiting_requests=0
    body = {"prompt": [1], "max_tokens": 250, "ignore_eos": True, "temperature": 0, "stream": True}
    with EngineGate(engine) as gate:  # no step: however fast the machine, none of them finishes meanwhile
        streams = [http.stream("POST", "/v1/completions", json=body) for _ in range(capacity)]
        try:
            for stream in streams:
                stream.__enter__()  # admitted: its engine request is added as the response body starts
            wait_until(
                lambda: engine.num_unfinished == capacity, message="the requests never reached the engine"
            )
            assert_error(
                http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}), 503, None, "overloaded"
            )
        finally:
            for stream in streams:
                stream.__exit__(None, None, None)
        gate.wait_for_aborts(capacity)
    # Nothing left for the next test (other modules share this engine): the closed streams were aborted.
    wait_until(lambda: engine.num_unfinished == 0, message="closed streams left requests running")


class _DeadEngine:
    """An engine whose loop died: the only state /health and admission look at."""

    def __init__(self, live) -> None:
        self.engine = live.engine  # tokenizer, limits and validation still work
        self.error = RuntimeError("device lost")
        self.failure = f"the engine loop died: {self.error!r}"
        self.is_alive = False
        self.num_unfinished = 0


def test_dead_engine_makes_health_and_generation_503(engine):
    with serve_in_thread(build_app(_DeadEngine(engine), MODEL)) as dead:
        assert_error(httpx.get(f"{dead.base_url}/health"), 503, None, "device lost")
        body = {"prompt": "x", "max_tokens": 1}
        assert_error(httpx.post(f"{dead.base_url}/v1/completions", json=body), 503, None, "not running")


NO_SYSTEM_ROLE = (  # as Gemma's template refuses a system message
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
)


def test_a_role_the_chat_template_refuses_is_400_naming_it_and_a_value_error_offline(
    engine, default_tokenizer
):
    from jpaged.engine.tokenizer import apply_chat_template

    messages = [{"role": "system", "content": "Be brief."}, *HI]
    with serve_in_thread(build_app(engine, MODEL, chat_template=NO_SYSTEM_ROLE)) as running:
        response = httpx.post(f"{running.base_url}/v1/chat/completions", json={"messages": messages})
        accepted = httpx.post(
            f"{running.base_url}/v1/chat/completions", json={"messages": HI, "max_tokens": 1}
        )
    assert_error(response, 400, "messages", "System role not supported")
    assert accepted.status_code == 200
    with pytest.raises(ValueError, match="System role not supported"):
        apply_chat_template(default_tokenizer, messages, chat_template=NO_SYSTEM_ROLE)
