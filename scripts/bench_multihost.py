"""One engine over two processes on localhost (jax.distributed, the CPU backend, 2 simulated devices each,
tensor_parallel_size 4) beside the same engine in one process (4 simulated devices): the decode step's time, and
what process 0's control message to the follower costs each step (its pickled size and the time to send it), beside
`multihost_utils.broadcast_one_to_all` of a few sizes (the device-collective way to send the same bytes), timed in
the same pair. All processes share this machine's cores, so the step times show the cost of crossing processes, not
of a network.

Config as scripts/bench_tp.py (a random 4-layer Llama-shaped model, 512 wide, 8 query and 4 KV heads, SmolLM2's
vocabulary; N requests of 64 random prompt tokens, greedy, async scheduling off), saved as an orbax checkpoint that
every process loads. Median over --steps decode steps.

  python scripts/bench_multihost.py                 # N = 8, 64
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BROADCAST_BYTES = (4 << 10, 16 << 10, 64 << 10)


def save_model(directory: Path) -> None:
    from bench_overlap import tiny_random

    from jpaged.models.checkpoint import save_checkpoint
    from jpaged.models.loader import load_model

    dims = dict(
        num_layers=4, hidden_size=512, intermediate_size=2048, num_heads=8, num_kv_heads=4, head_dim=64
    )
    model = tiny_random(load_model(None, progress=False), np.random.default_rng(0), **dims)
    save_checkpoint(directory, model.config, model.params, model.tokenizer)


def decode_steps(model: str, sizes: list[int], steps: int) -> dict:
    """Median decode step ms per size, and each control message's send time and size during the timed steps
    (none in one process)."""
    from bench_overhead import start_decoding
    from bench_overlap import decode_step_times

    from jpaged.config import EngineConfig
    from jpaged.engine.llm_engine import LLMEngine
    from jpaged.runner.multihost import Followers
    from jpaged.sampling_params import RequestOutputKind, SamplingParams

    sends: list[tuple[float, int]] = []
    send = Followers.send

    def timed_send(self, message) -> None:
        start = time.perf_counter()
        send(self, message)
        sends.append((time.perf_counter() - start, len(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))))

    Followers.send = timed_send
    rng = np.random.default_rng(0)
    results = {}
    for size in sizes:
        config = EngineConfig(
            model=model,
            max_num_seqs=size,
            max_num_batched_tokens=max(256, size),
            max_model_len=512,
            num_blocks=1 + size * 32,
            tensor_parallel_size=4,
            async_scheduling=False,
        )
        engine = LLMEngine(config)
        params = SamplingParams(
            max_tokens=steps + 8 + 64 * size // config.max_num_batched_tokens,
            temperature=0.0,
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        start_decoding(engine, size, params, rng)
        sends.clear()
        step = statistics.median(decode_step_times(engine, steps, size))
        results[size] = {
            "step_ms": step * 1e3,
            "send_us": statistics.median(t for t, _ in sends) * 1e6 if sends else None,
            "bytes": int(statistics.median(n for _, n in sends)) if sends else None,
        }
        del engine
    return results


def broadcast_us(repeats: int = 30) -> dict:
    """Median µs of broadcast_one_to_all of each size (its first call, which compiles, left out)."""
    from jax.experimental import multihost_utils

    times = {}
    for nbytes in BROADCAST_BYTES:
        payload = np.zeros(nbytes, np.uint8)
        runs = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            multihost_utils.broadcast_one_to_all(payload)
            runs.append(time.perf_counter() - start)
        times[nbytes] = statistics.median(runs[1:]) * 1e6
    return times


def child(args: argparse.Namespace) -> None:
    sizes = list(map(int, args.sizes.split(",")))
    if args.role == "one":
        print(json.dumps({"steps": decode_steps(args.model, sizes, args.steps)}))
        return
    import jpaged

    leader = jpaged.initialize_distributed() == 0
    broadcasts = broadcast_us()
    if not leader:
        sys.exit(jpaged.follow())
    print(json.dumps({"steps": decode_steps(args.model, sizes, args.steps), "broadcast_us": broadcasts}))


def run_child(args: argparse.Namespace, role: str, model: Path, env: dict, **popen) -> subprocess.Popen:
    command = [sys.executable, __file__, "--role", role, "--model", str(model)]
    command += ["--sizes", args.sizes, "--steps", str(args.steps)]
    return subprocess.Popen(command, env={**os.environ, **env}, text=True, **popen)


def last_json(process: subprocess.Popen) -> dict:
    out, _ = process.communicate()
    if process.returncode:
        raise SystemExit(f"a benchmark process failed (rc {process.returncode})")
    return json.loads(out.strip().splitlines()[-1])  # gloo prints to stdout as well


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="8,64")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--role", choices=("one", "pair"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        child(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        save_model(model)
        devices = "--xla_force_host_platform_device_count="
        quiet = dict(stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        one = last_json(run_child(args, "one", model, {"XLA_FLAGS": devices + "4"}, **quiet))
        with socket.socket() as sock:
            sock.bind(("localhost", 0))
            port = sock.getsockname()[1]
        env = {
            "XLA_FLAGS": devices + "2",
            "JAX_COORDINATOR_ADDRESS": f"localhost:{port}",
            "JAX_NUM_PROCESSES": "2",
        }
        follower = run_child(args, "pair", model, {**env, "JAX_PROCESS_ID": "1"}, **quiet)
        two = last_json(run_child(args, "pair", model, {**env, "JAX_PROCESS_ID": "0"}, **quiet))
        follower.communicate()
    print(
        "tp 4: one process of 4 simulated CPU devices, or two processes of 2 (jax.distributed on localhost)"
    )
    print(
        "| running sequences | one process step ms | two processes step ms | ratio | control message bytes |"
        " send µs |"
    )
    print("|---|---|---|---|---|---|")
    for size, single in one["steps"].items():
        pair = two["steps"][size]
        print(
            f"| {size} | {single['step_ms']:.2f} | {pair['step_ms']:.2f} | "
            f"{pair['step_ms'] / single['step_ms']:.2f} | {pair['bytes']} | {pair['send_us']:.0f} |"
        )
    sizes = ", ".join(f"{int(n) >> 10} KiB {us:.0f} µs" for n, us in two["broadcast_us"].items())
    print(f"\nmultihost_utils.broadcast_one_to_all in the same pair (median of 30): {sizes}")
    print("\ncommand: python scripts/bench_multihost.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
