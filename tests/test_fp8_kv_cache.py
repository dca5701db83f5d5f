"""`--kv-cache-dtype fp8`: the KV pool in float8 e4m3 holds twice the tokens of a bfloat16 one in the same memory,
the attention the engine picks reads it as the XLA reference does, generation stays the model's, preemption by swap
keeps every output, nothing compiles after warm-up, and `jpaged plan` counts one byte an element (and the weights as held)."""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest
from test_prefix_doctor import figure, plan

from jpaged import LLM, SamplingParams
from jpaged.config import EngineConfig

ARGS = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory=2**24)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = ["The capital of France is", "Count with me: one, two, three,", "A haiku about the sea " * 6]


def token_lists(llm: LLM, params=GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def fp8():
    return LLM(kv_cache_dtype="fp8", **ARGS)


def test_the_same_memory_holds_twice_the_tokens_of_bfloat16():
    blocks = {
        kv: LLM(kv_cache_dtype=kv, dtype="bfloat16", enforce_eager=True, **ARGS).metrics()["num_total_blocks"]
        + 1
        for kv in ("auto", "fp8")
    }  # + 1: the reserved block, which the memory holds too
    assert blocks["fp8"] // 2 == blocks["auto"]


def test_the_pool_is_float8_and_the_engines_attention_reads_it_as_the_xla_reference(fp8):
    # On CPU the C++ kernel's pool holds e4m3 as its bytes (XLA CPU writes those in place, not float8).
    assert fp8.engine.runner.kv_cache.k.dtype == jnp.uint8
    reference = LLM(kv_cache_dtype="fp8", attention_impl="reference", **ARGS)
    assert reference.engine.runner.kv_cache.k.dtype == jnp.float8_e4m3fn
    assert fp8.engine.runner.attention_impl != "reference"  # the C++ kernel on CPU
    assert token_lists(fp8) == token_lists(reference)


def test_generation_stays_the_models_and_compiles_nothing_after_warm_up(fp8):
    compiled = fp8.metrics()["num_compilations"]
    (answer,) = fp8.generate(["The capital of France is"], GREEDY, use_tqdm=False)
    assert "Paris" in answer.outputs[0].text
    mixed = [GREEDY, SamplingParams(max_tokens=6, n=2, temperature=0.8, seed=3, logprobs=2), GREEDY]
    fp8.generate(PROMPTS, mixed, use_tqdm=False)
    assert fp8.metrics()["num_compilations"] == compiled


def test_preemption_by_swap_keeps_every_output(fp8):
    # 17 usable blocks of 16 tokens; the three requests need 23 by their last tokens.
    tight = LLM(kv_cache_dtype="fp8", num_blocks=18, preemption_mode="swap", swap_space=0.01, **ARGS)
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    outputs = token_lists(tight, long)
    assert tight.metrics()["num_preemptions"] > 0
    assert outputs == token_lists(fp8, long)


def test_plan_counts_one_byte_an_element(capsys):
    bfloat16, fp8 = plan(capsys, "chat_en.jsonl"), plan(capsys, "chat_en.jsonl", "--kv-cache-dtype", "fp8")
    assert figure(fp8, "KV bytes per token") * 2 == figure(bfloat16, "KV bytes per token")
    assert figure(fp8, "sequences that fit at p95") > 1.9 * figure(bfloat16, "sequences that fit at p95")
    assert "KV cache in float8 e4m3" in fp8


def test_an_unknown_kv_cache_dtype_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


def test_plan_counts_the_weights_as_the_engine_holds_them(capsys):
    """The embedded GGUF's blocks as stored (98 MB), not as bfloat16 (269 MB): the rest is KV cache."""
    kept = plan(capsys, "chat_en.jsonl")
    dense = plan(capsys, "chat_en.jsonl", "--quantization", "none")
    int8 = plan(capsys, "chat_en.jsonl", "--quantization", "int8")
    assert "MiB uint8" in kept and "MiB uint8" not in dense and "MiB int8" in int8
    weights = {
        name: int(re.search(r"- ([\d,]+) bytes of weights", out).group(1).replace(",", ""))
        for name, out in (("kept", kept), ("dense", dense), ("int8", int8))
    }
    assert weights["kept"] < 0.4 * weights["dense"] and weights["int8"] < 0.7 * weights["dense"]
    assert figure(kept, "sequences that fit at p95") > figure(dense, "sequences that fit at p95")
    # Split three ways the blocks stay blocks, as the engine keeps them: a third of them a device.
    split = plan(capsys, "chat_en.jsonl", "--tensor-parallel-size", "3")
    assert "MiB uint8" in split
    assert (
        int(re.search(r"- ([\d,]+) bytes of weights", split).group(1).replace(",", ""))
        == weights["kept"] // 3
    )
