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

from jpaged.benchmarks.datasets import add_dataset_args, requests_from

if TYPE_CHECKING:
    from jpaged.benchmarks.serve_metrics import ServeMetrics

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="the server, e.g. http://host:8000"
    )
    parser.add_argument("--model", default=None, help="the served model's name (default: the server's one)")
    add_dataset_args(parser, num_prompts=100, input_len=1024)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf")
    parser.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson; below 1 burstier")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument(
        "--ignore-eos", action="store_true", help="generate max_tokens whatever the model says"
    )
    add_figure_args(parser)
    parser.add_argument("--goodput", nargs="+", default=None, help="SLOs in ms, e.g. ttft:500 tpot:50")
    parser.add_argument("--seed", type=int, default=0, help="the random dataset's and the arrivals'")
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--result-filename", default=None, help="default: bench-serve-<time>.json")
    sweeps = parser.add_mutually_exclusive_group()
    sweeps.add_argument(
        "--sweep-concurrency", default=None, help="e.g. 1,4,16,64: one run per max concurrency"
    )
    sweeps.add_argument(
        "--sweep-request-rate", default=None, help="e.g. 1,4,16,inf: one run per request rate (requests/s)"
    )
    parser.add_argument("--plot", default=None, help="with a sweep: the dial as a PNG (matplotlib)")


@dataclasses.dataclass(frozen=True)
class Point:
    """One run of a sweep (or the single run): its max concurrency and request rate."""

    max_concurrency: int | None
    request_rate: float


def sweep_points(args: argparse.Namespace) -> tuple[str | None, list[Point]]:
    """The dial a sweep turns ("max concurrency" or "request rate", None for one run) and its points."""
    if args.request_rate <= 0 or args.burstiness <= 0:
        raise ValueError("request_rate and burstiness must be > 0")
    if args.sweep_concurrency is not None:
        values = _sweep_values("sweep_concurrency", args.sweep_concurrency, int)
        return "max concurrency", [Point(v, args.request_rate) for v in values]
    if args.sweep_request_rate is not None:
        values = _sweep_values("sweep_request_rate", args.sweep_request_rate, float)
        return "request rate", [Point(args.max_concurrency, v) for v in values]
    return None, [Point(args.max_concurrency, args.request_rate)]


def _sweep_values(name: str, given: str, parse: type) -> list:
    try:
        values = [parse(v) for v in given.split(",")]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated numbers, got {given!r}") from None
    if not all(v > 0 for v in values):
        raise ValueError(f"{name} values must be > 0, got {given}")
    return values


def dial_value(dial: str, point: Point) -> str:
    return str(point.max_concurrency if dial == "max concurrency" else f"{point.request_rate:g}")


def add_figure_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--percentile-metrics", default=",".join(METRIC_NAMES))
    parser.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    parser.add_argument("--disable-tqdm", action="store_true")


def figures_asked(args: argparse.Namespace) -> tuple[list[str], list[float]]:
    """The latencies to report and their percentiles, from --percentile-metrics and --metric-percentiles."""
    selected = [name.strip() for name in args.percentile_metrics.split(",") if name.strip()]
    unknown = [name for name in selected if name not in METRIC_NAMES]
    if unknown:
        raise ValueError(f"percentile_metrics: {unknown} are not among {', '.join(METRIC_NAMES)}")
    try:
        return selected, [float(p) for p in args.metric_percentiles.split(",")]
    except ValueError:
        raise ValueError("metric_percentiles must be comma-separated numbers") from None


def report(metrics: ServeMetrics, selected: list[str], title: str = "Serving Benchmark Result") -> str:
    """vllm bench serve's result table."""
    lines = ["{s:{c}^50}".format(s=f" {title} ", c="=")]

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
    if metrics.spec_decode is not None:
        lines += metrics.spec_decode.report()
    lines.append("=" * 50)
    return "\n".join(lines)


def sweep_table(dial: str, points: list[tuple[Point, ServeMetrics]]) -> str:
    """One row per point of the dial: the throughput against the latencies it costs."""
    rows = [
        f"| {dial} | req/s | output tok/s | median TTFT ms | p99 TTFT ms | median TPOT ms | p99 TPOT ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for point, m in points:
        p99 = max(m.ttft.percentiles)  # the highest percentile asked for (99 by default)
        rows.append(
            f"| {dial_value(dial, point)} | {m.request_throughput:.2f} | {m.output_throughput:.1f} | "
            f"{m.ttft.median:.1f} | {m.ttft.percentiles[p99]:.1f} | {m.tpot.median:.1f} | "
            f"{m.tpot.percentiles[p99]:.1f} |"
        )
    return "\n".join(rows)


def plot_sweep(dial: str, points: list[tuple[Point, ServeMetrics]], path: Path) -> None:
    """Output tokens/s against median and p99 TPOT and TTFT, each point labelled with its dial setting."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plot needs matplotlib: pip install 'jpaged[bench]'") from None
    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(1, 2, figsize=(11, 4.5))
    throughput = [m.output_throughput for _, m in points]
    for ax, name, title in ((axes[0], "tpot", "TPOT"), (axes[1], "ttft", "TTFT")):
        for label, value in (
            ("median", lambda d: d.median),
            ("p99", lambda d: d.percentiles[max(d.percentiles)]),
        ):
            latency = [value(getattr(m, name)) for _, m in points]
            ax.plot(latency, throughput, marker="o", label=f"{label} {title}")
            for (point, _), x, y in zip(points, latency, throughput, strict=True):
                text = dial_value(dial, point)
                ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("output tokens/s")
        ax.grid(alpha=0.3)
        ax.legend()
    figure.suptitle(f"throughput against latency, by {dial}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def run_bench_serve(args: argparse.Namespace) -> int:
    from jpaged.benchmarks.serve_client import run_requests
    from jpaged.benchmarks.serve_metrics import parse_goodput, serve_metrics
    from jpaged.benchmarks.spec_decode_counts import scrape

    selected, percentiles = figures_asked(args)
    dial, sweep = sweep_points(args)
    goodput = parse_goodput(args.goodput) if args.goodput else None
    requests = requests_from(args)
    points = []
    for point in sweep:
        before = scrape(args.base_url)
        timings, duration = asyncio.run(
            run_requests(
                args.base_url,
                args.model,
                requests,
                request_rate=point.request_rate,
                burstiness=args.burstiness,
                max_concurrency=point.max_concurrency,
                ignore_eos=args.ignore_eos,
                seed=args.seed,
                progress=not args.disable_tqdm,
            )
        )
        metrics = serve_metrics(timings, duration, percentiles, goodput)
        if dial:
            print(f"{dial} {dial_value(dial, point)}:")
        after = scrape(args.base_url)
        if before is not None and after is not None:  # a speculating server: the run's acceptance
            metrics = dataclasses.replace(metrics, spec_decode=after - before)
        print(report(metrics, selected))
        points.append((point, metrics))
    if dial:
        print(sweep_table(dial, points))
        if args.plot:
            plot_sweep(dial, points, Path(args.plot))
            print(f"plotted {args.plot}")
    if args.save_result:
        path = Path(args.result_filename or f"bench-serve-{time.strftime('%Y%m%d-%H%M%S')}.json")
        config = {k: v for k, v in vars(args).items() if k != "run"}
        results = [{**dataclasses.asdict(p), **dataclasses.asdict(m)} for p, m in points]
        saved = {"config": config, **results[0]} if not dial else {"config": config, "points": results}
        path.write_text(json.dumps(saved, indent=2, default=str))
        print(f"saved {path}")
    return 0 if all(m.completed for _, m in points) else 1
