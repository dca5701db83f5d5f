"""Continuous batching keeps every request's greedy output: alone, batched, chunked, preempted, prefix-cached."""

from __future__ import annotations

import pytest
from engine_driver import run_requests
from greedy import assert_same_greedy

from jpaged.config import EngineConfig
from jpaged.core.prefix_doctor import SAMPLE
from jpaged.engine.llm_engine import LLMEngine
from jpaged.models.loader import load_model
from jpaged.sampling_params import SamplingParams

PROMPTS = [
    "The history of the Roman Empire begins",
    "Here is a recipe for a simple tomato soup. First,",
    "In computer science, a hash table is",
    "ท้องฟ้าวันนี้",
    "List three colours: red,",
    "The quick brown fox jumps over the lazy dog. " * 6,
]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, logprobs=2, ignore_eos=True)
BASE = dict(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, num_blocks=160, enforce_eager=True)


@pytest.fixture(scope="module")
def model():
    return load_model(None, progress=False)


def run(engine: LLMEngine, prompts: list[str], params: SamplingParams = GREEDY) -> list:
    done = run_requests(engine, {f"r{i}": (prompt, params) for i, prompt in enumerate(prompts)})
    return [done[f"r{i}"].outputs[0] for i in range(len(prompts))]


def make(model, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(**{**BASE, **overrides}), model=model)


@pytest.fixture(scope="module")
def solo(model):
    """Each prompt alone in a fresh engine: the reference every other schedule must reproduce."""
    engine = make(model, enable_prefix_caching=False)
    return [run(engine, [p])[0] for p in PROMPTS]


def assert_all_same(reference, outputs, label):
    for ref, out in zip(reference, outputs, strict=True):
        assert_same_greedy(ref, out.token_ids, label)


def test_full_batch_equals_solo(model, solo):
    assert_all_same(solo, run(make(model), PROMPTS), "full batch")


def test_chunked_prefill_equals_solo(model, solo):
    engine = make(model, max_num_batched_tokens=16)  # every prompt is split over several steps
    assert_all_same(solo, run(engine, PROMPTS), "chunked prefill")


def test_prefill_without_chunking_equals_solo(model, solo):
    engine = make(model, enable_chunked_prefill=False, max_num_batched_tokens=128)
    assert_all_same(solo, run(engine, PROMPTS), "unchunked prefill")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_equals_solo_and_frees_everything(model, solo, mode):
    engine = make(model, max_model_len=128, num_blocks=12, preemption_mode=mode, swap_space=0.05)
    outputs = run(engine, PROMPTS)
    metrics = engine.metrics()
    assert metrics["num_preemptions"] > 0
    if mode == "swap":
        assert engine.blocks.num_swapped_out_blocks > 0 and engine.blocks.num_swapped_in_blocks > 0
    assert_all_same(solo, outputs, f"preemption by {mode}")
    engine.reset_prefix_cache()
    assert engine.metrics()["num_free_blocks"] == engine.metrics()["num_total_blocks"]


def test_prefix_caching_serves_a_shared_800_token_prefix_and_keeps_outputs(model):
    system = " ".join(f"rule {i}: be brief and exact." for i in range(85))
    engine = make(model, max_model_len=1024, num_blocks=200, max_num_batched_tokens=512)
    prefix_len = len(engine.tokenizer.encode(system))
    assert prefix_len >= 800
    questions = [system + " Question: what is 2 + 2?", system + " Question: name a colour."]
    first = run(engine, questions[:1])
    hits_before = engine.blocks.prefix_cache_hits
    second = run(engine, questions[1:])
    hits = engine.blocks.prefix_cache_hits - hits_before
    assert hits == prefix_len // 16 * 16  # every full block of the shared prefix, nothing more
    uncached = make(
        model, max_model_len=1024, num_blocks=200, max_num_batched_tokens=512, enable_prefix_caching=False
    )
    assert_all_same(first + second, run(uncached, questions), "prefix caching off")


def test_prefix_differing_at_position_zero_shares_nothing(model):
    engine = make(model)
    body = " the same long body of text follows here and goes on for a while." * 5
    run(engine, ["12:00:01" + body], SamplingParams(max_tokens=1))
    before = engine.blocks.prefix_cache_hits
    run(engine, ["12:00:02" + body], SamplingParams(max_tokens=1))
    assert engine.blocks.prefix_cache_hits == before


def test_a_varying_head_before_a_shared_body_is_logged_once_from_the_first_requests(model, caplog):
    body = " ".join(f"rule {i}: answer in one short sentence." for i in range(12))
    stamped, well_formed = make(model), make(model)
    with caplog.at_level("WARNING", logger="jpaged.engine.llm_engine"):
        for i in range(2 * SAMPLE):
            stamped.add_request(f"stamped-{i}", f"2026-12-01 12:{i // 60:02d}:{i % 60:02d} {body} Q{i}?")
            well_formed.add_request(f"well-{i}", f"{body} 2026-12-01 12:{i // 60:02d}:{i % 60:02d} Q{i}?")
    hints = [r.getMessage() for r in caplog.records if "prefix caching" in r.getMessage()]
    assert len(hints) == 1 and f"{SAMPLE} of {SAMPLE} requests" in hints[0] and "stamped-" in hints[0]
    for engine in (stamped, well_formed):
        for request_id in list(engine.requests):
            engine.abort_request(request_id)


def test_abort_frees_blocks_at_once(model):
    engine = make(model)
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50))
    engine.step()
    assert engine.metrics()["kv_cache_usage_perc"] > 0
    output = engine.abort_request("a")
    assert output.outputs[0].finish_reason == "abort"
    assert engine.metrics()["kv_cache_usage_perc"] == 0
    assert not engine.has_unfinished()
