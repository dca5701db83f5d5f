"""`jpaged bench throughput`: every request added at once to an in-process engine, EOS ignored, each step's new
tokens for a request timed as one chunk, and bench serve's figures and JSON made from those timings; vLLM's random
dataset spreads lengths by its range ratio."""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import pytest

from jpaged.benchmarks.bench_throughput import run_offline
from jpaged.benchmarks.datasets import BenchRequest, random_lengths, requests_from
from jpaged.benchmarks.serve_metrics import ServeMetrics
from jpaged.entrypoints.cli import main
from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.sampling_params import RequestOutputKind


class ScriptedEngine:
    """Returns, step by step, the delta outputs it was given: {request id: new token count} per step."""

    def __init__(self, steps: list[dict[str, int]]):
        self.steps = steps
        self.added: dict[str, tuple] = {}
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt, params):
        self.added[request_id] = (prompt, params)

    def has_unfinished(self) -> bool:
        return bool(self.steps)

    def step(self) -> list[RequestOutput]:
        step = self.steps.pop(0)
        return [
            RequestOutput(
                request_id,
                None,
                list(self.added[request_id][0]),
                [CompletionOutput(0, "", [7] * new)],
                finished=not any(request_id in later for later in self.steps),
            )
            for request_id, new in step.items()
        ]

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_each_steps_new_tokens_are_one_chunk_timed_at_that_step():
    # The clock reads 10.0 at the start, once after each step, and once at the end.
    clock = iter([10.0, 10.5, 10.7, 11.0, 11.6]).__next__
    engine = ScriptedEngine([{"bench-0": 1, "bench-1": 1}, {"bench-0": 1}, {"bench-0": 2, "bench-1": 1}])
    requests = [BenchRequest([1, 2, 3], 3, 4), BenchRequest([4, 5], 2, 2)]
    timings, duration = run_offline(engine, requests, clock=clock)
    assert duration == pytest.approx(1.6)
    first, second = timings
    assert (first.prompt_tokens, first.output_tokens) == (3, 4)
    assert first.ttft == pytest.approx(0.5) and first.latency == pytest.approx(1.0)
    assert first.itl == pytest.approx((0.2, 0.3))
    assert first.tpot == pytest.approx(0.5 / 3)
    assert (second.prompt_tokens, second.output_tokens, second.ttft, second.latency) == (2, 2, 0.5, 1.0)
    assert second.itl == pytest.approx((0.5,))
    _, params = engine.added["bench-0"]
    assert params.ignore_eos and params.temperature == 0.0 and params.max_tokens == 4
    assert params.output_kind is RequestOutputKind.DELTA


def test_an_interrupted_run_aborts_every_request():
    class Interrupted(ScriptedEngine):
        def step(self):
            raise KeyboardInterrupt

    engine = Interrupted([{"bench-0": 1}])
    with pytest.raises(KeyboardInterrupt):
        run_offline(engine, [BenchRequest([1], 1, 1), BenchRequest([2], 1, 1)])
    assert engine.aborted == ["bench-0", "bench-1"]


def dataset(**overrides) -> argparse.Namespace:
    values = dict(
        dataset="random",
        num_prompts=400,
        random_input_len=100,
        random_output_len=50,
        random_range_ratio=0.5,
        seed=0,
    )
    return argparse.Namespace(**(values | overrides))


def test_the_range_ratio_spreads_lengths_uniformly_around_the_asked_one():
    requests = requests_from(dataset())
    inputs = [len(r.prompt) for r in requests]
    assert inputs == [r.prompt_tokens for r in requests]
    assert min(inputs) == 50 and max(inputs) == 150
    assert {r.max_tokens for r in requests} == set(range(25, 76))
    assert random_lengths(10, 0.0, 5, np.random.default_rng(0)) == [10] * 5
    assert min(random_lengths(1, 0.9, 50, np.random.default_rng(0))) == 1  # never an empty prompt


def test_a_range_ratio_outside_zero_to_one_is_refused_by_name():
    with pytest.raises(ValueError, match="random_range_ratio"):
        requests_from(dataset(random_range_ratio=1.0))


def test_the_cli_reports_bench_serves_figures_in_its_json_shape(tiny_model_dir, tmp_path, capsys):
    result = tmp_path / "throughput.json"
    model = str(tiny_model_dir("smollm2_tied"))
    code = main(
        ["bench", "throughput", "--model", model, "--num-prompts", "5", "--random-input-len", "12",
         "--random-output-len", "6", "--max-model-len", "64", "--max-num-seqs", "4", "--num-blocks", "64",
         "--max-num-batched-tokens", "32", "--disable-tqdm", "--output-json", str(result)]
    )  # fmt: skip
    assert code == 0
    saved = json.loads(result.read_text())
    assert set(saved) == {"config", "compilations_after_warmup"} | {
        f.name for f in dataclasses.fields(ServeMetrics)
    }
    assert (saved["completed"], saved["total_input_tokens"], saved["total_output_tokens"]) == (5, 60, 30)
    assert saved["compilations_after_warmup"] == 0
    assert saved["output_throughput"] == pytest.approx(30 / saved["duration_s"])
    assert 0 < saved["ttft"]["mean"] < saved["e2el"]["mean"] <= saved["duration_s"] * 1e3
    assert saved["itl"]["median"] > 0
    out = capsys.readouterr().out
    assert "Throughput: " in out and "Offline Throughput Result" in out
