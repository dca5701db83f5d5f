"""`jpaged bench serve`: vllm bench serve's benchmark (its flag names and its figures) against any
OpenAI-compatible server, printed as its table and saved as JSON. The client's imports (httpx, numpy) wait for
the run: the `jpaged` command parses its flags on every start."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jpaged.benchmarks.serve_client import BenchRequest
    from jpaged.benchmarks.serve_metrics import ServeMetrics

RANDOM_TOKEN_IDS = (100, 10_000)  # random prompts' token ids: inside any real model's vocabulary


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="the server, e.g. http://host:8000"
    )
    parser.add_argument("--model", default=None, help="the served model's name (default: the server's one)")
    parser.add_argument(
        "--dataset", default="random", help="'random', or a JSONL file of {prompt, max_tokens}"
    )
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf")
    parser.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson; below 1 burstier")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument(
        "--ignore-eos", action="store_true", help="generate max_tokens whatever the model says"
    )
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    parser.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    parser.add_argument("--goodput", nargs="+", default=None, help="SLOs in ms, e.g. ttft:500 tpot:50")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--result-filename", default=None, help="default: bench-serve-<time>.json")
    parser.add_argument("--disable-tqdm", action="store_true")


def requests_from(args: argparse.Namespace) -> list[BenchRequest]:
    """The dataset: random token ids of the random lengths, or the JSONL file's prompts, --num-prompts of them
    (a file shorter than that is cycled)."""
    import numpy as np

    from jpaged.benchmarks.serve_client import BenchRequest

    if args.num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {args.num_prompts}")
    if args.dataset == "random":
        if args.random_input_len < 1 or args.random_output_len < 1:
            raise ValueError("random_input_len and random_output_len must be >= 1")
        rng = np.random.default_rng(args.seed)
        return [
            BenchRequest(
                rng.integers(*RANDOM_TOKEN_IDS, args.random_input_len).tolist(),
                args.random_input_len,
                args.random_output_len,
            )
            for _ in range(args.num_prompts)
        ]
    path = Path(args.dataset)
    if not path.is_file():
        raise ValueError(f"dataset {args.dataset!r} is neither 'random' nor a file")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            row = json.loads(line)
            if not isinstance(row.get("prompt"), str):
                raise ValueError(f"dataset {path} line {number}: needs a 'prompt' string")
            rows.append(BenchRequest(row["prompt"], 0, int(row.get("max_tokens", args.random_output_len))))
    if not rows:
        raise ValueError(f"dataset {path} has no requests")
    return [rows[i % len(rows)] for i in range(args.num_prompts)]


def report(metrics: ServeMetrics, selected: list[str]) -> str:
    """vllm bench serve's result table."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(name: str, value) -> None:
        lines.append(f"{name:<40}{value:<10.2f}" if isinstance(value, float) else f"{name:<40}{value:<10}")

    row("Successful requests:", metrics.completed)
    row("Failed requests:", metrics.failed)
    row("Benchmark duration (s):", metrics.duration_s)
    row("Total input tokens:", metrics.total_input_tokens)
    row("Total generated tokens:", metrics.total_output_tokens)
    row("Request throughput (req/s):", metrics.request_throughput)
    if metrics.request_goodput is not None:
        row("Request goodput (req/s):", metrics.request_goodput)
    row("Output token throughput (tok/s):", metrics.output_throughput)
    row("Total Token throughput (tok/s):", metrics.total_token_throughput)
    titles = {
        "ttft": ("Time to First Token", "TTFT"),
        "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
        "itl": ("Inter-token Latency", "ITL"),
        "e2el": ("End-to-end Latency", "E2EL"),
    }
    for name in selected:
        title, short = titles[name]
        distribution = getattr(metrics, name)
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        row(f"Mean {short} (ms):", distribution.mean)
        row(f"Median {short} (ms):", distribution.median)
        for p, value in distribution.percentiles.items():
            row(f"P{p:g} {short} (ms):", value)
    lines.append("=" * 50)
    return "\n".join(lines)


def run_bench_serve(args: argparse.Namespace) -> int:
    from jpaged.benchmarks.serve_client import run_requests
    from jpaged.benchmarks.serve_metrics import parse_goodput, serve_metrics

    selected = [name.strip() for name in args.percentile_metrics.split(",") if name.strip()]
    unknown = [name for name in selected if name not in ("ttft", "tpot", "itl", "e2el")]
    if unknown:
        raise ValueError(f"percentile_metrics: {unknown} are not among ttft, tpot, itl, e2el")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    except ValueError:
        raise ValueError(f"metric_percentiles must be numbers, got {args.metric_percentiles!r}") from None
    if args.request_rate <= 0 or args.burstiness <= 0:
        raise ValueError("request_rate and burstiness must be > 0")
    goodput = parse_goodput(args.goodput) if args.goodput else None
    requests = requests_from(args)
    timings, duration = asyncio.run(
        run_requests(
            args.base_url,
            args.model,
            requests,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            ignore_eos=args.ignore_eos,
            seed=args.seed,
            progress=not args.disable_tqdm,
        )
    )
    metrics = serve_metrics(timings, duration, percentiles, goodput)
    print(report(metrics, selected))
    if args.save_result:
        path = Path(args.result_filename or f"bench-serve-{time.strftime('%Y%m%d-%H%M%S')}.json")
        config = {k: v for k, v in vars(args).items() if k not in ("run",)}
        path.write_text(json.dumps({"config": config, **dataclasses.asdict(metrics)}, indent=2, default=str))
        print(f"saved {path}")
    return 0 if metrics.completed else 1
