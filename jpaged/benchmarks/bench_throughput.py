"""`jpaged bench throughput`: the offline benchmark, in-process, as `vllm bench throughput` runs it (every request
added at once, EOS ignored, greedy), with bench serve's figures and JSON: each request's tokens are timed at the
engine step that returns them, so TTFT, TPOT and ITL are the engine's own, without HTTP between."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from jpaged.benchmarks.bench_serve import add_figure_args, figures_asked, report
from jpaged.benchmarks.datasets import BenchRequest, add_dataset_args, requests_from

if TYPE_CHECKING:
    from jpaged.benchmarks.serve_metrics import RequestTiming
    from jpaged.config import EngineConfig
    from jpaged.engine.llm_engine import LLMEngine


def add_bench_throughput_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model path, GGUF file, orbax dir or hub id")
    add_dataset_args(parser, num_prompts=64, input_len=128)
    add_figure_args(parser)
    parser.add_argument("--output-json", default=None, help="save the figures (bench serve's JSON shape)")


def run_offline(
    engine: LLMEngine,
    requests: Sequence[BenchRequest],
    clock: Callable[[], float] = time.perf_counter,
    on_finished: Callable[[], None] = lambda: None,
) -> tuple[list[RequestTiming], float]:
    """Every request's timing (in the order given) and the wall time from the first add to the last token. Each
    step's new tokens for a request count as one chunk, as a streamed server sends them."""
    from jpaged.benchmarks.serve_metrics import RequestTiming
    from jpaged.sampling_params import RequestOutputKind, SamplingParams

    ids = [f"bench-{i}" for i in range(len(requests))]
    chunks: dict[str, list[float]] = {request_id: [] for request_id in ids}
    tokens = dict.fromkeys(ids, 0)
    prompt_tokens = {}
    start = clock()
    try:
        for request_id, request in zip(ids, requests, strict=True):
            params = SamplingParams(
                max_tokens=request.max_tokens,
                temperature=0.0,
                ignore_eos=True,
                output_kind=RequestOutputKind.DELTA,
            )
            engine.add_request(request_id, request.prompt, params)
        while engine.has_unfinished():
            outputs = engine.step()
            now = clock() - start
            for output in outputs:
                new = len(output.outputs[0].token_ids)
                if new:
                    chunks[output.request_id].append(now)
                    tokens[output.request_id] += new
                prompt_tokens[output.request_id] = len(output.prompt_token_ids)
                if output.finished:
                    on_finished()
    except BaseException:
        for request_id in ids:  # an interrupt must not leave requests holding blocks
            engine.abort_request(request_id)
        raise
    duration = clock() - start
    timings = []
    for request_id in ids:
        times = chunks[request_id]
        gaps = tuple(b - a for a, b in itertools.pairwise(times))
        timings.append(
            RequestTiming(True, prompt_tokens[request_id], tokens[request_id], times[0], gaps, times[-1])
        )
    return timings, duration


def run_bench_throughput(args: argparse.Namespace, config: EngineConfig) -> int:
    from tqdm.auto import tqdm

    from jpaged.benchmarks.serve_metrics import serve_metrics
    from jpaged.engine.llm_engine import LLMEngine

    selected, percentiles = figures_asked(args)
    requests = requests_from(args)
    engine = LLMEngine(config)
    warm = engine.metrics()["num_compilations"]
    with tqdm(total=len(requests), desc="requests", disable=args.disable_tqdm) as bar:
        timings, duration = run_offline(engine, requests, on_finished=lambda: bar.update(1))
    metrics = serve_metrics(timings, duration, percentiles)
    compiled = engine.metrics()["num_compilations"] - warm
    print(
        f"Throughput: {metrics.request_throughput:.2f} requests/s, {metrics.total_token_throughput:.2f} "
        f"total tokens/s, {metrics.output_throughput:.2f} output tokens/s"
    )
    print(report(metrics, selected, title="Offline Throughput Result"))
    print(f"compilations after warm-up: {compiled}")
    if args.output_json:
        config_saved = {k: v for k, v in vars(args).items() if k != "run"}
        saved = {"config": config_saved, **dataclasses.asdict(metrics), "compilations_after_warmup": compiled}
        Path(args.output_json).write_text(json.dumps(saved, indent=2, default=str))
        print(f"saved {args.output_json}")
    return 0
