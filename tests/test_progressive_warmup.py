"""Progressive warm-up: an engine serves once the smallest steps' programs are compiled, builds only steps those
programs fit while the rest compile in the background, and takes the bigger steps as they land; no step ever waits
on a compilation, and the outputs are those of a fully warmed engine.

The background compilations are held at a gate the test opens, so what is observed never depends on how fast the
machine compiles.
"""

from __future__ import annotations

import threading

import pytest
from engine_driver import run_requests
from test_scheduler import make, request, run_step

from jpaged.config import EngineConfig
from jpaged.engine.llm_engine import LLMEngine
from jpaged.entrypoints.cli import build_parser, engine_config_from_args
from jpaged.runner import background_warmup
from jpaged.runner.step_shapes import StepShapes
from jpaged.runner.warmup_stages import READY_TOKENS, warmup_stages
from jpaged.sampling_params import SamplingParams

CONFIGS = [(512, 64), (64, 16), (100, 5), (8, 8), (4, 4), (2048, 256)]


@pytest.mark.parametrize(("tokens", "seqs"), CONFIGS)
def test_the_stages_compile_every_program_once_smallest_steps_first(tokens, seqs):
    shapes = StepShapes(tokens, seqs)
    stages = warmup_stages(shapes)
    assert stages[0].max_num_batched_tokens == min(READY_TOKENS, tokens)
    assert [s.max_num_batched_tokens for s in stages] == sorted({s.max_num_batched_tokens for s in stages})
    assert (stages[-1].max_num_batched_tokens, stages[-1].max_num_seqs) == (tokens, seqs)
    compiled = [shape for stage in stages for shape in stage.shapes]
    assert sorted(compiled) == sorted(shapes.all_shapes())  # each once
    rows = [rows for stage in stages for rows in stage.sampling_rows]
    assert sorted(rows) == sorted({s for _, s in shapes.all_shapes()})
    assert sorted(t for stage in stages for t in stage.prompt_tokens) == sorted(shapes.token_sizes)
    assert tuple(sorted(r for stage in stages for r in stage.copy_rows)) == shapes.copy_sizes


@pytest.mark.parametrize(("tokens", "seqs"), CONFIGS[:5])
def test_every_step_within_a_stages_limits_pads_to_a_shape_compiled_by_then(tokens, seqs):
    shapes = StepShapes(tokens, seqs)
    compiled: set[tuple[int, int]] = set()
    rows_compiled: set[int] = set()
    for stage in warmup_stages(shapes):
        compiled.update(stage.shapes)
        rows_compiled.update(stage.sampling_rows)
        for num_tokens in range(1, stage.max_num_batched_tokens + 1):
            for num_rows in range(
                1, stage.max_num_seqs + 1
            ):  # rows past tokens: a prompt forking its samples
                shape = shapes.shape_for(num_tokens, num_rows)
                assert shape in compiled and shape[1] in rows_compiled, (stage, num_tokens, num_rows)


def test_the_scheduler_keeps_to_lowered_limits_and_takes_more_once_they_rise():
    scheduler = make(max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.limit_steps(8, 2)
    scheduler.add(request(1, 20))
    scheduler.add(request(2, 4, n=3))  # needs three sequence slots at once: waits for them
    assert run_step(scheduler) == [(1, 8)]
    assert run_step(scheduler) == [(1, 8)]
    assert run_step(scheduler) == [(1, 4)]
    assert [seq.seq_id for seq in scheduler.waiting] == [2]
    scheduler.limit_steps(64, 4)
    assert run_step(scheduler) == [(1, 1), (2, 4)]


class GatedBackground:
    """Holds every background warm-up at its start until `open()`."""

    def __init__(self, monkeypatch) -> None:
        self._gate = threading.Event()
        run = background_warmup.BackgroundWarmup._run

        def gated(warmup) -> None:
            self._gate.wait()
            run(warmup)

        monkeypatch.setattr(background_warmup.BackgroundWarmup, "_run", gated)

    def open(self) -> None:
        self._gate.set()


def small_engine(tiny_model_dir, **overrides) -> LLMEngine:
    args = dict(max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64, num_blocks=64)
    return LLMEngine(EngineConfig(model=str(tiny_model_dir("smollm2_tied")), **{**args, **overrides}))


def finish_warmup(engine: LLMEngine) -> None:
    """What a server loop does with nothing to step, until the background warm-up is over."""
    while engine.warmup.remaining:
        if not engine.warm_up_while_idle():
            engine.warmup.wait(timeout=1.0)
    engine.warm_up_while_idle()


REQUESTS = {
    "long": (list(range(100, 150)), SamplingParams(max_tokens=6, temperature=0.0)),
    "short": (list(range(200, 205)), SamplingParams(max_tokens=9, temperature=0.0)),
    "samples": (list(range(300, 320)), SamplingParams(n=3, max_tokens=4, temperature=0.8, seed=5)),
}


def texts(outputs) -> dict:
    return {rid: [list(c.token_ids) for c in out.outputs] for rid, out in outputs.items()}


@pytest.fixture(scope="module")
def full_outputs(tiny_model_dir):
    engine = small_engine(tiny_model_dir)
    return engine.metrics()["num_compilations"], texts(run_requests(engine, REQUESTS))


def test_a_progressive_engine_serves_small_steps_first_then_all_with_the_outputs_of_a_full_one(
    tiny_model_dir, monkeypatch, full_outputs
):
    gate = GatedBackground(monkeypatch)
    engine = small_engine(tiny_model_dir, warmup="progressive")
    first = engine.metrics()
    assert first["warmup_programs_remaining"] > 0
    assert (engine.scheduler.max_num_batched_tokens, engine.scheduler.max_num_seqs) == (8, 8)
    assert texts(run_requests(engine, REQUESTS)) == full_outputs[1]  # chunks of 8 tokens, the same tokens
    held = engine.metrics()
    assert held["num_live_compilations"] == 0 and held["num_compilations"] == first["num_compilations"]
    gate.open()
    finish_warmup(engine)
    done = engine.metrics()
    assert done["warmup_programs_remaining"] == 0 and engine.runner.num_unrun_shapes == 0
    assert (engine.scheduler.max_num_batched_tokens, engine.scheduler.max_num_seqs) == (64, 16)
    assert done["num_compilations"] == full_outputs[0]  # every program a full warm-up compiles, no other
    assert texts(run_requests(engine, REQUESTS)) == full_outputs[1]
    assert engine.metrics()["num_live_compilations"] == 0


def test_a_request_needing_more_sequences_than_compiled_waits_for_its_stage_without_compiling(
    tiny_model_dir, monkeypatch
):
    gate = GatedBackground(monkeypatch)
    engine = small_engine(tiny_model_dir, warmup="progressive")
    engine.add_request("wide", list(range(10, 20)), SamplingParams(n=12, max_tokens=3, seed=1))
    for _ in range(3):
        assert engine.step() == []  # each waits (briefly) for a stage instead of spinning
    assert [seq.request.request_id for seq in engine.scheduler.waiting] == ["wide"]
    gate.open()
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert len(outputs[-1].outputs) == 12 and outputs[-1].finished
    assert engine.metrics()["num_live_compilations"] == 0


def test_jpaged_serve_warms_up_progressively_unless_told_full_and_llm_engines_fully():
    parse = build_parser().parse_args
    assert engine_config_from_args(parse(["serve"])).warmup == "progressive"
    assert engine_config_from_args(parse(["serve", "--warmup", "full"])).warmup == "full"
    assert engine_config_from_args(parse(["generate", "hi"])).warmup == EngineConfig().warmup == "full"
    with pytest.raises(ValueError, match="warmup"):
        EngineConfig(warmup="lazy")
