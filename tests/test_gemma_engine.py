"""Gemma 2 and 3 through the engine: greedy generation follows transformers with chunked prefill, prompts past the
sliding window, a reused cached prefix, preemption and new weights; a Gemma 3 (local and global layers) warms up
exactly the programs a Llama does and compiles nothing after, whatever the requests ask."""

from __future__ import annotations

import json

import jax
import pytest
from greedy import assert_follows_transformers, generate_greedy, tokens_of

from jpaged import LLM, SamplingParams
from jpaged.models.loader import load_model
from jpaged.sampling_params import StructuredOutputsParams

# Chunks of 16 tokens, so the 45-token prompt is prefilled in three steps; every prompt crosses the window (8).
ARGS = dict(max_model_len=96, max_num_batched_tokens=16, max_num_seqs=4)
PROMPTS = [[(7 * i + 3) % 4000 + 100 for i in range(n)] for n in (10, 45, 30, 38)]


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, tiny_model_dir):
    model_dir = tiny_model_dir(request.param)
    return model_dir, LLM(str(model_dir), **ARGS)


def test_greedy_follows_transformers_past_the_window_in_chunks_and_from_a_cached_prefix(gemma):
    model_dir, llm = gemma
    assert_follows_transformers(
        model_dir, generate_greedy(llm, PROMPTS[:2], 20), f"{model_dir.name}, fresh", 2e-5
    )
    hits = llm.metrics()["prefix_cache_hits"]
    (extended,) = generate_greedy(
        llm, [PROMPTS[1] + [500, 501, 502, 503, 504]], 20
    )  # its first 32 tokens are cached
    assert llm.metrics()["prefix_cache_hits"] > hits
    assert_follows_transformers(model_dir, [extended], f"{model_dir.name}, cached prefix", 2e-5)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_every_greedy_output(gemma, mode):
    model_dir, llm = gemma
    # 8 blocks of 16 for four sequences of up to 58 tokens: they cannot all run at once.
    tight = LLM(
        str(model_dir), **ARGS, num_blocks=8, preemption_mode=mode, swap_space=0.01, enforce_eager=True
    )
    outputs = tokens_of(generate_greedy(tight, PROMPTS, 20))
    assert tight.metrics()["num_preemptions"] > 0
    assert outputs == tokens_of(generate_greedy(llm, PROMPTS, 20))


def test_new_weights_generate_as_a_fresh_engine_on_them_and_compile_nothing(gemma):
    model_dir, llm = gemma
    loaded = load_model(str(model_dir), progress=False)
    compiled = llm.metrics()["num_compilations"]
    before = tokens_of(generate_greedy(llm, PROMPTS[:2], 20))
    new = jax.tree_util.tree_map(lambda leaf: -leaf, loaded.params)  # every weight, the norms' w too
    llm.update_weights(new)
    after = tokens_of(generate_greedy(llm, PROMPTS[:2], 20))
    assert after != before
    fresh = LLM.from_params(new, loaded.config, loaded.tokenizer, **ARGS)
    assert after == tokens_of(generate_greedy(fresh, PROMPTS[:2], 20))
    assert llm.metrics()["num_compilations"] == compiled


def test_gemma3_warms_up_the_programs_of_a_llama_and_compiles_nothing_after(tiny_model_dir):
    """Its local and global layers are one scanned layer program: warm-up compiles what a Llama's does, and a
    mixed workload (chunked prompts past the window, sampling with n > 1, logprobs, a JSON schema, beams) after
    it compiles nothing."""
    llama = LLM(str(tiny_model_dir("llama")), **ARGS)
    llm = LLM(str(tiny_model_dir("gemma3")), **ARGS)
    compiled = llm.metrics()["num_compilations"]
    assert compiled == llama.metrics()["num_compilations"] > 0
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, logprobs=3),
        SamplingParams(max_tokens=8, n=2, temperature=0.8, seed=1),
        SamplingParams(
            max_tokens=30, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema)
        ),
        SamplingParams(max_tokens=8, top_k=5, top_p=0.9, temperature=0.7, seed=2, prompt_logprobs=1),
    ]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    structured = outputs[2].outputs[0]
    if structured.finish_reason == "stop":  # a tiny random model may run out of tokens inside the object
        assert isinstance(json.loads(structured.text)["n"], int)
    llm.beam_search([{"prompt_token_ids": PROMPTS[1]}], beam_width=3, max_tokens=4)
    assert llm.metrics()["num_compilations"] == compiled
