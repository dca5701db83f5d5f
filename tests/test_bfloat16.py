"""bfloat16 on CPU: the pool is stored as its 16-bit words so XLA writes it in place, outputs survive every
path that moves KV blocks (copy-on-write, swap), and greedy output follows float32's on the embedded model."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from engine_driver import run_requests
from greedy import BFLOAT16_NEAR_TIE, assert_same_greedy

from jpaged.config import EngineConfig
from jpaged.engine.llm_engine import LLMEngine
from jpaged.models.loader import load_model
from jpaged.sampling_params import SamplingParams

ARGS = dict(
    dtype="bfloat16",
    attention_impl="cpu",
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=128,
    enforce_eager=True,
)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
PROMPTS = [list(range(100 + 7 * i, 140 + 7 * i)) for i in range(6)]


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), jnp.bfloat16, progress=False)


def run(engine: LLMEngine, params: SamplingParams = GREEDY) -> list:
    done = run_requests(engine, {f"r{i}": (prompt, params) for i, prompt in enumerate(PROMPTS)})
    return [done[f"r{i}"].outputs[0] for i in range(len(PROMPTS))]


def test_the_step_writes_the_bfloat16_pool_in_place_without_widening_it(model):
    """XLA CPU turned every write into a bfloat16 pool into a float32 copy of the whole pool and back (a decode
    step of the default model took ~45 s); the pool's 16-bit words are written in place."""
    engine = LLMEngine(EngineConfig(num_blocks=40, **ARGS), model=model)
    run(engine)
    pool = engine.runner.kv_cache.k
    assert pool.dtype == jnp.uint16
    widened = "f32[" + ",".join(map(str, pool.shape)) + "]"
    programs = [compiled.as_text() for compiled in engine.runner.programs.forwards.values()]
    assert programs and not any(widened in text for text in programs)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_bfloat16_greedy_output_survives_preemption(model, mode):
    solo = [
        run_requests(LLMEngine(EngineConfig(num_blocks=40, **ARGS), model=model), {"r": (p, GREEDY)})["r"]
        for p in PROMPTS
    ]
    tight = LLMEngine(EngineConfig(num_blocks=12, preemption_mode=mode, swap_space=0.01, **ARGS), model=model)
    outputs = run(tight)
    assert tight.metrics()["num_preemptions"] > 0
    for reference, output in zip(solo, outputs, strict=True):
        assert_same_greedy(reference.outputs[0], output.token_ids, f"bfloat16, preempted by {mode}")


def test_bfloat16_parallel_samples_continue_from_their_copied_blocks(model):
    """n samples share the prompt's partial last block and copy it when they first write to it."""
    engine = LLMEngine(EngineConfig(num_blocks=40, **ARGS), model=model)
    params = SamplingParams(max_tokens=6, temperature=0.8, n=3, seed=5, ignore_eos=True)
    outputs = run_requests(engine, {"r": (PROMPTS[0][:21], params)})["r"].outputs
    assert len(outputs) == 3 and all(len(o.token_ids) == 6 for o in outputs)
    assert engine.metrics()["num_free_blocks"] == engine.metrics()["num_total_blocks"]


def test_bfloat16_greedy_output_follows_float32_on_the_embedded_model_but_at_near_ties(default_tokenizer):
    """The embedded model's weights and pool in bfloat16 (the CPU kernels' bfloat16 paths, matmul and
    attention) give float32's greedy tokens, or part from them only where float32's top two logits were
    within bfloat16's rounding of a logit."""
    texts = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "def fibonacci(n):",
        "List three prime numbers and explain why they are prime.",
    ]
    params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=2, ignore_eos=True)
    requests = {f"r{i}": (default_tokenizer.encode(text), params) for i, text in enumerate(texts)}
    args = dict(ARGS, max_model_len=256, max_num_batched_tokens=128, num_blocks=64)
    outputs = {
        dtype: run_requests(LLMEngine(EngineConfig(**dict(args, dtype=dtype))), requests)
        for dtype in ("float32", "bfloat16")
    }
    for request_id in requests:
        reference, output = (outputs[dtype][request_id].outputs[0] for dtype in ("float32", "bfloat16"))
        assert_same_greedy(reference, output.token_ids, f"bfloat16 {request_id}", BFLOAT16_NEAR_TIE)


def test_a_bfloat16_step_moves_no_more_bytes_than_one_and_a_half_float32_steps(tiny_llama_dir):
    """The regression check for the widened pool, on any machine: XLA's own count of the bytes each compiled
    step program reads and writes (its cost analysis, not a timing). Half-width weights and pool make a bfloat16
    step move about half a float32 one's bytes; the pool widened around every write made it twice a float32
    step's (measured 0.61x and 2.1x here). The pool is made far bigger than the tiny model's weights so that
    what happens to it dominates the count."""
    moved = {}
    for dtype in ("float32", "bfloat16"):
        model = load_model(str(tiny_llama_dir), jnp.dtype(dtype), progress=False)
        engine = LLMEngine(EngineConfig(num_blocks=16000, **dict(ARGS, dtype=dtype)), model=model)
        run(engine)
        moved[dtype] = {
            layout: compiled.cost_analysis()["bytes accessed"]
            for layout, compiled in engine.runner.programs.forwards.items()
        }
    assert moved["float32"].keys() == moved["bfloat16"].keys()
    for layout, float32_bytes in moved["float32"].items():
        assert moved["bfloat16"][layout] <= 1.5 * float32_bytes, layout
