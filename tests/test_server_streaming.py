"""Server-sent events, client disconnects, and the drain on shutdown (in-process and `jpaged serve` + SIGTERM)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from engine_gate import EngineGate
from jpaged_server.api_server import build_app
from server_harness import serve_in_thread

MODEL = "tiny-smollm2"
LONG = {
    "prompt": [1],
    "max_tokens": 250,
    "ignore_eos": True,
    "temperature": 0,
}  # an abort shows as fewer tokens generated than this


@pytest.fixture(scope="module")
def server(engine):
    with serve_in_thread(build_app(engine, MODEL)) as running:
        yield running


def events(lines) -> list[str]:
    """The `data:` payloads of an SSE stream, asserting that nothing else is in it."""
    payloads = []
    for line in lines:
        if line:
            assert line.startswith("data: "), line
            payloads.append(line.removeprefix("data: "))
    return payloads


def wait_until_idle(engine, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = engine.metrics()
        if metrics["num_requests_running"] == 0 and metrics["kv_cache_usage_perc"] == 0:
            return metrics
        assert time.monotonic() < deadline, f"the engine still holds requests: {metrics}"
        time.sleep(0.02)


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_is_data_events_then_done_with_usage_only_when_asked(server, include_usage):
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = events(response.iter_lines())
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices[-1]["choices"][0]["finish_reason"] == "length"
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage == (
        [
            {
                "prompt_tokens": 1,
                "completion_tokens": 4,
                "total_tokens": 5,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
        ]
        if include_usage
        else []
    )


def test_client_disconnect_mid_stream_aborts_the_request_and_frees_its_blocks(server, engine):
    before = engine.metrics()["generation_tokens"]
    url, body = f"{server.base_url}/v1/completions", {**LONG, "stream": True}
    with EngineGate(engine, steps=1) as gate:  # one step for the first event, then none: it cannot finish
        with httpx.stream("POST", url, json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            assert engine.metrics()["kv_cache_usage_perc"] > 0
        gate.wait_for_aborts(1)
    after = wait_until_idle(engine)
    assert after["generation_tokens"] - before < LONG["max_tokens"]  # stopped early: aborted, not finished


def test_client_disconnect_while_waiting_for_a_whole_response_aborts_it(server, engine):
    """The client gives up while the held engine cannot have finished, so the request must be aborted."""

    async def post_and_give_up(gate: EngineGate) -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            post = asyncio.create_task(client.post("/v1/completions", json=LONG))
            assert await asyncio.to_thread(gate.parked.wait, 60), "the request never reached the engine"
            assert not post.done(), post  # still waiting for its whole response
            post.cancel()  # the client gives up: its connection closes
            with contextlib.suppress(asyncio.CancelledError):
                await post

    before = engine.metrics()["generation_tokens"]
    with EngineGate(engine) as gate:
        asyncio.run(post_and_give_up(gate))
        gate.wait_for_aborts(1)
    after = wait_until_idle(engine)
    assert after["generation_tokens"] - before < LONG["max_tokens"]


def wait_for_status(url: str, status: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(url).status_code != status:
        assert time.monotonic() < deadline, f"{url} never answered {status}"
        time.sleep(0.02)


def test_drain_refuses_new_requests_and_finishes_in_flight_ones(engine):
    with (
        serve_in_thread(build_app(engine, MODEL), grace_period=30) as running,
        EngineGate(engine, steps=1) as gate,  # the request is still in flight when the drain begins
    ):
        body = {"prompt": [1], "max_tokens": 40, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{running.base_url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            first = next(lines)
            running.server.request_shutdown()
            wait_for_status(f"{running.base_url}/ready", 503)
            assert httpx.get(f"{running.base_url}/health").status_code == 200  # alive: no restart mid-drain
            refused = httpx.post(f"{running.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
            gate.release()
            payloads = events([first, *lines])
        assert payloads[-1] == "[DONE]"
        chunks = [json.loads(p) for p in payloads[:-1]]
        assert all("error" not in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 1
        deadline = time.monotonic() + 10
        while not running.server.should_exit:
            assert time.monotonic() < deadline, "the server did not exit after draining"
            time.sleep(0.02)


def test_grace_period_end_aborts_in_flight_streams_with_an_error_event(engine):
    body = {**LONG, "stream": True}
    before = engine.metrics()["generation_tokens"]
    # The engine held after the first event: the request outlasts the grace period, however fast the machine.
    with (
        EngineGate(engine, steps=1) as gate,
        serve_in_thread(build_app(engine, MODEL), grace_period=0.2) as running,
        httpx.stream("POST", f"{running.base_url}/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        first = next(lines)
        running.server.request_shutdown()
        payloads = events([first, *lines])
        gate.wait_for_aborts(1)
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error["code"] == 503 and "shutting down" in error["message"]
    assert wait_until_idle(engine)["generation_tokens"] - before < LONG["max_tokens"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_jpaged_serve_exits_zero_on_sigterm(tiny_model_dir):
    port = free_port()
    command = [sys.executable, "-m", "jpaged.entrypoints.cli", "--log-level", "WARNING", "serve"]
    command += [str(tiny_model_dir("smollm2_tied")), "--port", str(port), "--served-model-name", MODEL]
    command += ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "256"]
    command += ["--num-blocks", "128", "--enforce-eager"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "jpaged serve did not become ready"
            time.sleep(0.2)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert models["data"][0]["id"] == MODEL
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
