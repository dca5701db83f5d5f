"""A real uvicorn server on a free local port in a background thread, for tests and scripts.

Tests talk to it over HTTP like any client (the openai package, httpx), so they exercise the same stack as
production: uvicorn's protocol, streaming, disconnects, the drain on shutdown.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from fastapi import FastAPI
from jpaged_server.api_server import build_app
from jpaged_server.lifecycle import GracefulServer

from jpaged.config import EngineConfig
from jpaged.engine.async_engine import AsyncLLMEngine

# Limits small enough that a tiny model serves API tests in milliseconds per step and few step shapes compile.
SMALL_ENGINE_ARGS = dict(
    max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_blocks=128, enforce_eager=True
)

_shared_engines: dict[str, AsyncLLMEngine] = {}


def shared_engine(config: EngineConfig) -> AsyncLLMEngine:
    """One engine per configuration per process, so test modules that share it compile each step shape once."""
    key = repr(config)
    if key not in _shared_engines:
        _shared_engines[key] = AsyncLLMEngine.from_config(config)
    return _shared_engines[key]


def small_config(tiny_model_dir: Callable[[str], Path], **overrides) -> EngineConfig:
    """The server tests' model, the tiny tied-embedding SmolLM2 (conftest.py), under SMALL_ENGINE_ARGS."""
    return EngineConfig(model=str(tiny_model_dir("smollm2_tied")), **{**SMALL_ENGINE_ARGS, **overrides})


def small_engine(tiny_model_dir: Callable[[str], Path]) -> AsyncLLMEngine:
    """The engine the server tests share (conftest.py's `engine`): one per process, whichever module asks first."""
    return shared_engine(small_config(tiny_model_dir))


@contextlib.contextmanager
def http_client(engine: AsyncLLMEngine, served_model_name: str = "tiny") -> Iterator[httpx.Client]:
    """An httpx client on a live server over `engine`, both closed on exit."""
    with (
        serve_in_thread(build_app(engine, served_model_name)) as running,
        httpx.Client(base_url=running.base_url, timeout=60) as client,
    ):
        yield client


@dataclass
class RunningServer:
    base_url: str  # http://127.0.0.1:PORT
    server: GracefulServer
    app: FastAPI


@contextlib.contextmanager
def serve_in_thread(
    app: FastAPI, *, grace_period: float = 30.0, start_timeout: float = 30.0
) -> Iterator[RunningServer]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # the port stays ours from here on: no race with other processes
    port = sock.getsockname()[1]
    server = GracefulServer.for_app(app, "127.0.0.1", port, grace_period=grace_period, log_level="warning")
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"uvicorn did not start on port {port}")
        time.sleep(0.01)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", server, app)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def assert_400(response: httpx.Response, param: str, *words: str) -> None:
    """A 400 naming `param`, its message holding each of `words`."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]


def metric_samples(base_url: str, part: str, label: str) -> dict[str, float]:
    """The samples of the server's /metrics whose name holds `part`, keyed `name`, or `name{value}` where the
    sample has the label `label`."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text):
        for sample in family.samples:
            if part in sample.name:
                value = sample.labels.get(label)
                samples[f"{sample.name}{{{value}}}" if value else sample.name] = sample.value
    return samples
