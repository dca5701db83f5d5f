"""The engine gives the same greedy tokens with the Pallas kernel (interpret mode on CPU) and the C++ CPU kernel as
with the XLA reference."""

from __future__ import annotations

import jax.numpy as jnp

from jpaged import LLM, SamplingParams
from jpaged.models.llama import KVCache


def test_kernels_and_reference_generate_the_same_greedy_tokens(tiny_model_dir):
    prompts = [[11, 22, 33, 44, 55], list(range(100, 140))]  # a short prompt beside a multi-block one
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = {}
    for impl in ("reference", "pallas", "cpu"):
        llm = LLM(
            str(tiny_model_dir("qwen2_bias")),
            attention_impl=impl,
            max_model_len=128,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            num_blocks=32,
            enforce_eager=True,
        )
        if impl == "cpu":  # its pool is not zero-filled: whatever that memory held must not matter
            runner = llm.engine.runner
            runner.kv_cache = KVCache(*(jnp.full_like(pages, jnp.nan) for pages in runner.kv_cache))
        outputs[impl] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs["pallas"] == outputs["reference"]
    assert outputs["cpu"] == outputs["reference"]
    assert all(len(tokens) == 6 for tokens in outputs["pallas"])
