"""Readiness against a real `jpaged serve` process, from its start to its exit.

/health is liveness: 200 while the process can serve or will (loading, draining). /ready is readiness: 503 while
the weights load and warm-up compiles the smallest steps' programs, 200 from then on (the rest compile in the
background, and no request waits on a compilation), 503 again from SIGTERM on while the
in-flight streams finish within --shutdown-grace-period. The model's config.json is a pipe that this test writes only
after it has seen the loading answers, so loading cannot have finished before: no timing decides what is observed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

START_SECONDS = 300  # a cold warm-up on a loaded 2-core machine; only a hung server takes this long
MAX_TOKENS = 480  # the drained stream: long enough to be in flight when SIGTERM arrives (the log says it was)
ENGINE_FLAGS = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "512"]
ENGINE_FLAGS += ["--num-blocks", "128", "--shutdown-grace-period", "120"]


@dataclasses.dataclass
class Lifecycle:
    """What the test saw of one server process, phase by phase."""

    loading: dict[str, int]  # path -> status, while config.json had not been read
    ready_statuses: list[int]  # every /ready answer after config.json was written, up to the first 200
    log_at_ready: str
    compilations_at_ready: float
    live_compilations_after_request: float
    draining: dict[str, int]  # path -> status, after SIGTERM with a stream in flight
    refused: dict  # a new completion's body while draining
    chunks: list[dict]  # the in-flight stream's events, in order
    exit_code: int
    log: str


class GatedModel:
    """A copy of a model directory whose config.json is a pipe: loading blocks on it until `open_gate`."""

    def __init__(self, source: Path, root: Path) -> None:
        self.path = root / "gated-model"
        self.path.mkdir()
        for item in source.iterdir():
            if item.name != "config.json":
                (self.path / item.name).symlink_to(item)
        self._config = root / "config.json"  # the real file, moved in place of the pipe once it is read
        self._config.write_bytes((source / "config.json").read_bytes())
        self._pipe = self.path / "config.json"
        os.mkfifo(self._pipe)
        self._writer = threading.Thread(target=self._hand_over, daemon=True)

    def open_gate(self) -> None:
        self._writer.start()

    def _hand_over(self) -> None:
        """Give the loader the config through the pipe, and any later reader the file itself."""
        with open(self._pipe, "wb") as pipe:  # blocks until the loader opens it
            pipe.write(self._config.read_bytes())
            os.replace(
                self._config, self._pipe
            )  # before the loader sees the end: no reader opens a pipe again

    def close(self) -> None:
        if self._pipe.is_fifo():  # a writer may be waiting for a reader: give it one that reads nothing
            os.close(os.open(self._pipe, os.O_RDONLY | os.O_NONBLOCK))
        if self._writer.is_alive():
            self._writer.join(timeout=10)


def _get(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.TransportError:
        return None


def _metric(base_url: str, name: str) -> float:
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"/metrics has no {name}")


def _wait(process: subprocess.Popen, log: Path, what: str, done) -> None:
    deadline = time.monotonic() + START_SECONDS
    while not done():
        assert process.poll() is None, f"jpaged serve exited while {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"jpaged serve hung while {what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


@pytest.fixture(scope="session")
def lifecycle(tiny_model_dir, tmp_path_factory) -> Lifecycle:
    root = tmp_path_factory.mktemp("readiness")
    model = GatedModel(tiny_model_dir("smollm2_tied"), root)
    process, base_url, log = _serve(model, root)
    try:
        _wait(process, log, "starting to listen", lambda: _get(f"{base_url}/health") is not None)
        loading = {path: _get(f"{base_url}{path}") for path in ("/health", "/ready", "/v1/models")}
        model.open_gate()
        ready_statuses: list[int] = []

        def ready() -> bool:
            ready_statuses.append(_get(f"{base_url}/ready"))
            return ready_statuses[-1] == 200

        _wait(process, log, "loading", ready)
        log_at_ready = log.read_text()
        compilations_at_ready = _metric(base_url, "jpaged:num_compilations_total")
        body = {"prompt": [1], "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
            lines = (line.removeprefix("data: ") for line in response.iter_lines() if line)
            first = next(lines)
            live_compilations_after_request = _metric(base_url, "jpaged:num_live_compilations_total")
            process.send_signal(signal.SIGTERM)
            _wait(process, log, "draining", lambda: _get(f"{base_url}/ready") == 503)
            draining = {path: _get(f"{base_url}{path}") for path in ("/health", "/ready")}
            refused = httpx.post(
                f"{base_url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30
            )
            draining["/v1/completions"] = refused.status_code
            events = [first, *lines]
        assert events.pop() == "[DONE]"
        exit_code = process.wait(timeout=START_SECONDS)
        return Lifecycle(
            loading=loading,
            ready_statuses=ready_statuses,
            log_at_ready=log_at_ready,
            compilations_at_ready=compilations_at_ready,
            live_compilations_after_request=live_compilations_after_request,
            draining=draining,
            refused=refused.json(),
            chunks=[json.loads(event) for event in events],
            exit_code=exit_code,
            log=log.read_text(),
        )
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        model.close()


def _serve(model: GatedModel, root: Path) -> tuple[subprocess.Popen, str, Path]:
    """`jpaged serve` on the gated model: the process, its base URL and its log."""
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "jpaged.entrypoints.cli",
        "--log-level",
        "INFO",
        "serve",
        str(model.path),
    ]
    command += ["--port", str(port), "--compilation-cache-dir", str(root / "xla"), *ENGINE_FLAGS]
    log = root / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return process, f"http://127.0.0.1:{port}", log


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_while_the_model_loads_the_process_is_alive_but_not_ready(lifecycle):
    assert lifecycle.loading == {"/health": 200, "/ready": 503, "/v1/models": 503}


def test_ready_once_warm_up_has_compiled_the_first_steps_and_no_request_waits_on_a_compilation(lifecycle):
    assert set(lifecycle.ready_statuses[:-1]) <= {503} and lifecycle.ready_statuses[-1] == 200
    assert "warm-up:" in lifecycle.log_at_ready and "step programs compiled" in lifecycle.log_at_ready
    assert lifecycle.compilations_at_ready > 0
    assert lifecycle.live_compilations_after_request == 0


def test_sigterm_turns_readiness_off_keeps_liveness_on_and_refuses_new_requests(lifecycle):
    assert lifecycle.draining == {"/health": 200, "/ready": 503, "/v1/completions": 503}
    assert "shutting down" in lifecycle.refused["error"]["message"]


def test_the_in_flight_stream_finishes_within_the_grace_period_and_the_process_exits_zero(lifecycle):
    assert "draining: 1 requests in flight" in lifecycle.log  # SIGTERM came while the stream ran
    assert all("error" not in chunk for chunk in lifecycle.chunks)
    assert lifecycle.chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "grace period over" not in lifecycle.log
    assert lifecycle.exit_code == 0


def test_sigterm_while_the_model_loads_exits_zero_without_waiting_for_the_load(tiny_model_dir, tmp_path):
    """A pod deleted during a long load must not hold its node for the load: the loader never gets its config."""
    model = GatedModel(tiny_model_dir("smollm2_tied"), tmp_path)
    process, base_url, log = _serve(model, tmp_path)
    try:
        _wait(process, log, "starting to listen", lambda: _get(f"{base_url}/health") is not None)
        assert _get(f"{base_url}/ready") == 503
        process.send_signal(signal.SIGTERM)
        exit_code = process.wait(timeout=START_SECONDS)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        model.close()
    text = log.read_text()
    assert exit_code == 0, text[-3000:]
    assert "Traceback" not in text and "ready: weights loaded" not in text
