"""Faults and admission: a step that raises fails only its requests (a 500 in OpenAI's shape) and the engine serves
on; an engine loop that died makes /health unhealthy; past the waiting cap a request is refused with 503 and
Retry-After."""

from __future__ import annotations

import concurrent.futures
import json
import threading

import httpx
import pytest
from engine_gate import EngineGate, wait_until
from jpaged_server.api_server import build_app
from server_harness import serve_in_thread, shared_engine, small_config

from jpaged.engine.async_engine import AsyncLLMEngine

GREEDY = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(engine):
    with serve_in_thread(build_app(engine, "tiny", max_waiting_requests=0)) as running:
        yield running


def assert_error_shape(error: dict, status: int) -> None:
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, error


class FailOneDispatch:
    """The runner's next step, once armed, raises instead of starting its forward (a device fault)."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.runner = engine.engine.runner
        self.armed = threading.Event()
        self.fired = threading.Event()

    def __enter__(self) -> FailOneDispatch:
        forward = self.runner.forward

        def faulty(*args, **kwargs):
            if self.armed.is_set() and not self.fired.is_set():
                self.fired.set()
                raise RuntimeError("injected device fault")
            return forward(*args, **kwargs)

        self.runner.forward = faulty
        return self

    def __exit__(self, *exc_info) -> None:
        del self.runner.forward


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_failed_step_fails_only_its_requests_and_the_engine_serves_on(server, engine, stream):
    url = f"{server.base_url}/v1/completions"
    expected = httpx.post(url, json=GREEDY, timeout=60).json()["choices"][0]["text"]
    long_body = {"prompt": [1], "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": stream}
    # The gate parks the loop before the request's first step; the fault is armed for that step.
    with FailOneDispatch(engine) as fault, EngineGate(engine) as gate:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, url, json=long_body, timeout=60)
            assert gate.parked.wait(60), "the request never reached the engine"
            fault.armed.set()
            gate.release()
            response = answer.result()
        text = response.text
    assert fault.fired.is_set()
    if stream:
        assert response.status_code == 200  # the stream had begun: its last events are an error, then [DONE]
        events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
    else:
        assert response.status_code == 500, text
        error = json.loads(text)["error"]
    assert_error_shape(error, 500)
    assert "injected device fault" in error["message"]
    # The engine serves on, with the same output as before the fault, and nothing of the failed request is held.
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    again = httpx.post(url, json=GREEDY, timeout=60)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected
    metrics = engine.metrics()
    assert metrics["num_requests_running"] == metrics["num_requests_waiting"] == 0
    assert metrics["num_free_blocks"] == metrics["num_total_blocks"]


def test_an_engine_loop_that_died_makes_health_and_generation_503(tiny_model_dir):
    # An engine of its own: it does not survive this test.
    dying = AsyncLLMEngine.from_config(small_config(tiny_model_dir, num_blocks=64))
    try:
        with serve_in_thread(build_app(dying, "tiny")) as running:
            assert httpx.get(f"{running.base_url}/health").status_code == 200

            def broken_bookkeeping():  # outside any step: nothing to blame but the loop itself
                raise RuntimeError("engine bookkeeping broke")

            dying.engine.has_unfinished = broken_bookkeeping
            dying._wake.set()
            wait_until(lambda: not dying.is_alive, message="the engine loop did not die")
            health = httpx.get(f"{running.base_url}/health")
            assert health.status_code == 503
            assert_error_shape(health.json()["error"], 503)
            assert "engine bookkeeping broke" in health.json()["error"]["message"]
            response = httpx.post(f"{running.base_url}/v1/completions", json=GREEDY, timeout=60)
            assert response.status_code == 503
            assert_error_shape(response.json()["error"], 503)
    finally:
        dying.shutdown(timeout=5)


def test_past_the_waiting_cap_a_request_gets_503_with_retry_after(server, engine):
    capacity = engine.engine.config.max_num_seqs  # max_waiting_requests=0
    body = {"prompt": [1], "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
    url = f"{server.base_url}/v1/completions"
    with EngineGate(engine) as gate, httpx.Client(timeout=60) as client:
        streams = [client.stream("POST", url, json=body) for _ in range(capacity)]
        try:
            for stream in streams:
                stream.__enter__()
            wait_until(
                lambda: engine.num_unfinished == capacity, message="the requests never reached the engine"
            )
            refused = client.post(url, json={"prompt": "x", "max_tokens": 1})
        finally:
            for stream in streams:
                stream.__exit__(None, None, None)
        gate.wait_for_aborts(capacity)
    assert refused.status_code == 503
    assert_error_shape(refused.json()["error"], 503)
    assert int(refused.headers["Retry-After"]) >= 1
    # The clients that went away freed their blocks with their aborts.
    wait_until(lambda: engine.num_unfinished == 0, message="closed streams left requests running")
    metrics = engine.metrics()
    assert metrics["num_free_blocks"] == metrics["num_total_blocks"]


def test_a_request_queued_behind_a_failed_step_is_served_as_if_alone(tiny_model_dir):
    """One sequence at a time: the failed step ran only the first request; the one waiting behind it is not
    blamed, and its output is the one it gets alone."""
    single = shared_engine(small_config(tiny_model_dir, max_num_seqs=1))
    with serve_in_thread(build_app(single, "tiny")) as running:
        url = f"{running.base_url}/v1/completions"
        alone = httpx.post(url, json=GREEDY, timeout=60).json()["choices"][0]["text"]
        long_body = {"prompt": [1], "max_tokens": 200, "ignore_eos": True, "temperature": 0}
        with (
            FailOneDispatch(single) as fault,
            EngineGate(single) as gate,
            concurrent.futures.ThreadPoolExecutor(2) as pool,
        ):
            first = pool.submit(httpx.post, url, json=long_body, timeout=60)
            assert gate.parked.wait(60), "the first request never reached the engine"
            queued = pool.submit(httpx.post, url, json=GREEDY, timeout=60)
            wait_until(lambda: single.num_unfinished == 2, message="the second request was not queued")
            fault.armed.set()
            gate.release()
            failed, served = first.result(), queued.result()
        assert fault.fired.is_set()
        assert failed.status_code == 500 and "injected device fault" in failed.json()["error"]["message"]
        assert served.status_code == 200 and served.json()["choices"][0]["text"] == alone
    metrics = single.metrics()
    assert metrics["num_free_blocks"] == metrics["num_total_blocks"]
