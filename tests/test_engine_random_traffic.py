"""Warm-up leaves no trace; randomised traffic: nothing compiles after warm-up, nothing leaks, every request ends
exactly once."""

from __future__ import annotations

import random

import jax.numpy as jnp
import numpy as np
from engine_driver import run_requests

from jpaged.config import EngineConfig
from jpaged.engine.llm_engine import LLMEngine
from jpaged.runner import model_runner
from jpaged.sampling_params import SamplingParams


def assert_only_null_block_written(engine: LLMEngine) -> None:
    for pages in engine.runner.kv_cache:
        pages = np.asarray(pages)
        assert not np.all(pages[:, 0] == 1.0)  # the dummy runs' padding tokens wrote there
        assert np.all(pages[:, 1:] == 1.0)


def pool_of_ones(monkeypatch) -> None:
    """KV pools filled with ones (finite, as the reference attention needs): any write shows, even of zeros."""
    real = model_runner.init_kv_cache
    monkeypatch.setattr(
        model_runner,
        "init_kv_cache",
        lambda *args: real(*args[:4], allocate=jnp.ones),
    )


def small_engine(tiny_model_dir, **overrides) -> LLMEngine:
    args = dict(max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64, num_blocks=32)
    return LLMEngine(EngineConfig(model=str(tiny_model_dir("smollm2_tied")), **{**args, **overrides}))


def test_warm_up_runs_touch_only_the_null_block_and_change_no_output(tiny_model_dir, monkeypatch):
    pool_of_ones(monkeypatch)
    warm = small_engine(tiny_model_dir, attention_impl="reference")
    shapes = warm.runner.shapes.all_shapes()
    prefill_sized = [t for t, _ in shapes if t > warm.config.max_num_seqs]
    assert prefill_sized and warm.runner.num_unrun_shapes == len(prefill_sized)  # decode-sized ones ran
    assert_only_null_block_written(warm)
    runs = 0
    while warm.warm_up_while_idle():  # what a server loop does with nothing to step
        runs += 1
    assert runs == len(prefill_sized) and warm.runner.num_unrun_shapes == 0
    assert_only_null_block_written(warm)
    requests = {
        f"r{i}": (list(range(100 + i, 140 + 3 * i)), SamplingParams(max_tokens=12, temperature=0.0))
        for i in range(3)
    }
    eager = small_engine(tiny_model_dir, attention_impl="reference", enforce_eager=True)
    warm_out, eager_out = run_requests(warm, requests), run_requests(eager, requests)
    for request_id in requests:
        assert warm_out[request_id].outputs[0].token_ids == eager_out[request_id].outputs[0].token_ids
    # each step shape's forward, each row count's sampling (one history width: max_model_len under 1024), each
    # token size's prompt-logprobs program, each copy size's block copies
    assert warm.runner.sampling_widths.history_widths == (warm.config.max_model_len,)
    expected = len(shapes) + len({s for _, s in shapes}) + len(warm.runner.shapes.token_sizes)
    expected += len(warm.runner.shapes.copy_sizes)
    assert warm.metrics()["num_compilations"] == expected


def test_a_step_counts_as_its_shapes_first_run(tiny_model_dir):
    engine = small_engine(tiny_model_dir)
    before = engine.runner.num_unrun_shapes
    run_requests(engine, {"long": (list(range(100, 160)), SamplingParams(max_tokens=2))})  # a T=64 prefill
    assert engine.runner.num_unrun_shapes == before - 1


def test_300_random_requests_compile_nothing_after_warmup_and_free_every_block(tiny_model_dir):
    engine = small_engine(tiny_model_dir, max_model_len=256, num_blocks=48)  # tight: preemption happens
    compiled_at_warmup = engine.metrics()["num_compilations"]
    assert compiled_at_warmup > 0
    rng = random.Random(1234)
    finished, aborted, pending = set(), set(), []
    for i in range(300):
        pending.append(f"req-{i}")
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 4)):  # random arrivals between steps
            if not pending:
                break
            request_id = pending.pop(0)
            prompt = [rng.randrange(49152) for _ in range(rng.randint(1, 120))]
            sampled = rng.random() < 0.5
            params = SamplingParams(
                max_tokens=rng.randint(1, 40),
                temperature=0.8 if sampled else 0.0,
                top_p=0.9 if sampled else 1.0,
                seed=rng.randrange(1000) if sampled else None,
            )
            engine.add_request(request_id, prompt, params)
        running = list(engine.requests)
        if running and rng.random() < 0.05:
            victim = rng.choice(running)
            engine.abort_request(victim)
            aborted.add(victim)
        for output in engine.step():
            if output.finished:
                assert output.request_id not in finished
                finished.add(output.request_id)
    assert finished | aborted == {f"req-{i}" for i in range(300)}
    metrics = engine.metrics()
    assert metrics["num_compilations"] == compiled_at_warmup
    assert metrics["num_preemptions"] > 0
    assert metrics["kv_cache_usage_perc"] == 0.0
    engine.reset_prefix_cache()
    assert engine.metrics()["num_free_blocks"] == engine.metrics()["num_total_blocks"]
