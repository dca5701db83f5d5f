"""One engine over two processes: jax.distributed on localhost with the CPU backend, two simulated devices in each,
tensor_parallel_size 4 over all four. Process 0 decides every step and the follower repeats its device actions:
the tokens (and the engine's features) are those of one process, from the Python API and over HTTP (from an orbax
checkpoint, whose restore waits for every process), each process holds only its devices' shards, a follower's
death turns /health unhealthy, and process 0's death stops the follower."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from peft_adapters import make_adapter

WORKER = Path(__file__).with_name("multihost_worker.py")
# 64 blocks hold the 4 sequences of 128 tokens: the default pool (4 GiB a device, zero-filled under tensor
# parallelism) would hold 16 GiB across the two processes, more than the CI machine can spare beside the suite.
ENGINE_FLAGS = ["--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "32"]
ENGINE_FLAGS += ["--num-blocks", "64"]
START_SECONDS = 600  # loading and compiling in two processes on a 2-core CI machine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def process_env(coordinator_port: int, process_id: int) -> dict:
    return {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_COORDINATOR_ADDRESS": f"localhost:{coordinator_port}",
        "JAX_NUM_PROCESSES": "2",
        "JAX_PROCESS_ID": str(process_id),
    }


def last_json_line(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])  # gloo prints its connections to stdout too


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return str(tiny_model_dir("qwen2_bias"))  # biases, and a tied embedding split by vocabulary


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory) -> list[str]:
    """Two LoRA adapters of the model, of different ranks and targets (their slots written on every process)."""
    root = tmp_path_factory.mktemp("multihost_adapters")
    made = [
        make_adapter(Path(model), root, "all", rank=8, seed=1),
        make_adapter(Path(model), root, "qv", rank=4, targets=("q_proj", "v_proj"), seed=2),
    ]
    return ["--lora", ",".join(str(adapter.path) for adapter in made)]


@pytest.fixture(scope="module")
def one_process(model, adapters) -> dict:
    result = subprocess.run(
        [sys.executable, str(WORKER), model, "1", *adapters],
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return last_json_line(result.stdout)


def test_two_processes_generate_as_one_and_hold_their_devices_shards(model, adapters, one_process):
    port = free_port()
    follower = subprocess.Popen(
        [sys.executable, str(WORKER), model, "4", *adapters],
        env=process_env(port, 1),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    leader = subprocess.run(
        [sys.executable, str(WORKER), model, "4", *adapters],
        env=process_env(port, 0),
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
    )
    follower_stderr = follower.communicate(timeout=120)[1]
    assert leader.returncode == 0, leader.stderr[-3000:]
    assert follower.returncode == 0, follower_stderr[-3000:]  # process 0's exit told it to stop
    two = last_json_line(leader.stdout)
    assert two["run"]["tokens"] == one_process["run"]["tokens"]
    for ours, theirs in zip(two["run"]["logprobs"], one_process["run"]["logprobs"], strict=True):
        for step, expected in zip(ours, theirs, strict=True):
            assert step.keys() == expected.keys()
            assert all(abs(step[t] - expected[t]) < 1e-5 for t in step)
    # Prefix caching, n > 1, beam search and recompute preemption as in one process.
    assert two["features"] == one_process["features"]
    assert two["features"]["prefix hits"] > 0 and two["features"]["preemptions recompute"] > 0
    # Process 0 addresses two of the four devices, each holding a quarter of the weights and of the KV pool (the
    # model's two KV heads held twice over: see test_tensor_parallel).
    for name in ("qkv_bytes", "pool_bytes"):
        total, shards = two["run"][name]
        assert shards == [total // 4] * 2
    assert two["run"]["pool_bytes"][0] == 2 * one_process["run"]["pool_bytes"][0]
    assert any(op == "all-reduce" for op, _ in two["run"]["collectives"])
    assert two["run"]["placed as laid out"]  # each process cut its own devices' parts
    # LoRA adapters mixed with the base model: each adapter's slot written on both processes' devices.
    assert two["lora"]["tokens"] == one_process["lora"]["tokens"]


@pytest.fixture(scope="module")
def orbax_model(model, tmp_path_factory) -> str:
    """The same model as an orbax checkpoint (whose restore waits for every process)."""
    from jpaged.models.checkpoint import save_checkpoint
    from jpaged.models.loader import load_model

    loaded = load_model(model, progress=False)
    path = tmp_path_factory.mktemp("orbax") / "model"
    save_checkpoint(path, loaded.config, loaded.params, loaded.tokenizer)
    return str(path)


@pytest.fixture
def serving_pair(orbax_model, tmp_path):
    """`jpaged serve --distributed` in two processes; yields (base URL, leader, follower) once /ready is 200."""
    port, http_port = free_port(), free_port()
    command = [sys.executable, "-m", "jpaged.entrypoints.cli", "serve", orbax_model, "--distributed"]
    command += ["--tensor-parallel-size", "4", "--port", str(http_port), *ENGINE_FLAGS]
    logs = [tmp_path / f"process{i}.log" for i in (0, 1)]
    processes = [
        subprocess.Popen(command, env=process_env(port, i), stdout=log.open("w"), stderr=subprocess.STDOUT)
        for i, log in enumerate(logs)
    ]
    base_url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + START_SECONDS
        while _status(base_url, "/ready") != 200:
            for process, log in zip(processes, logs, strict=True):
                assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the pair did not start serving"
            time.sleep(0.5)
        yield base_url, *processes
    finally:
        for process in processes:
            process.kill()
            process.wait()


def _status(base_url: str, path: str) -> int | None:
    try:
        return httpx.get(f"{base_url}{path}", timeout=5).status_code
    except httpx.HTTPError:
        return None


def test_the_pair_serves_http_from_process_zero_and_a_lost_follower_turns_health_unhealthy(
    serving_pair, one_process
):
    base_url, leader, follower = serving_pair
    from tensor_parallel_worker import PROMPTS

    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    # The random model's tokens are byte pieces (no text to compare): each chosen token's logprob is one
    # process's, and so are the top 3 at each step.
    expected = one_process["run"]["tokens"][0]
    steps = one_process["run"]["logprobs"][0]
    chosen = [step[str(token)] for step, token in zip(steps, expected, strict=True)]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(chosen, abs=1e-5)
    for top, step in zip(choice["logprobs"]["top_logprobs"], steps, strict=True):
        assert sorted(top.values()) == pytest.approx(sorted(step.values())[-3:], abs=1e-5)

    follower.send_signal(signal.SIGKILL)
    follower.wait()
    deadline = time.monotonic() + 60  # the leader reads the follower's socket closing at once
    while (status := _status(base_url, "/health")) == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status == 503
    health = httpx.get(f"{base_url}/health", timeout=5)
    assert "follower process went away" in health.json()["error"]["message"]
    assert leader.poll() is None  # unhealthy, not hung or gone: the probe and the logs say why


def test_a_lost_process_zero_stops_the_follower_instead_of_hanging(serving_pair):
    """The follower cannot go on without the process that decides every step: JAX's coordination service (process
    0 hosts it) ends it, or its control socket closing does."""
    _, leader, follower = serving_pair
    leader.send_signal(signal.SIGKILL)
    leader.wait()
    assert follower.wait(timeout=120) != 0  # the timeout only catches a hang: it ends within a few seconds
