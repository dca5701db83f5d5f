"""RoPE scalings that follow the sequence's length (LongRoPE, dynamic NTK) through the engine: each token rotated
by max(its prompt's length, its position + 1), as transformers' generate does, whether the prompt is shorter or
longer than the original context, chunked or whole, and while decoding crosses it."""

from __future__ import annotations

import pytest
from greedy import assert_same_greedy, hf_greedy

from jpaged import LLM, SamplingParams

ORIGINAL = (
    32  # conftest's LongRoPE models' original_max_position_embeddings; dynamic's max_position_embeddings
)


@pytest.mark.parametrize("family", ["phi3_longrope", "phi3_partial_rotary", "llama_dynamic"])
def test_greedy_follows_transformers_below_across_and_above_the_original_context(family, tiny_model_dir):
    model_dir = tiny_model_dir(family)
    # Chunks of 16 tokens: the 45-token prompt is prefilled in three steps, each token rotated for 45.
    llm = LLM(str(model_dir), max_model_len=96, max_num_batched_tokens=16, max_num_seqs=4, enforce_eager=True)
    # Prompts shorter than the original context (decoding crosses it) and longer.
    prompts = [[(7 * i + 3) % 4000 + 100 for i in range(n)] for n in (10, 45)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)
    for output in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False):
        tokens, logprobs = hf_greedy(model_dir, output.prompt_token_ids, 30)
        label = f"{family}, prompt {len(output.prompt_token_ids)}"
        assert_same_greedy(output.outputs[0], tokens, label)
        # A tiny random model's argmax barely depends on RoPE; its logprobs do.
        ours = [step[token].logprob for step, token in zip(output.outputs[0].logprobs, tokens, strict=True)]
        assert ours == pytest.approx(logprobs, abs=2e-5), label


def test_a_prefix_cached_for_a_short_prompt_is_not_reused_for_a_long_one(tiny_model_dir):
    """The short prompt's keys are rotated by the short factors, the long prompt's by the long ones: reusing the
    cached prefix would give other logits, so a length-dependent RoPE turns prefix caching off."""
    model_dir = tiny_model_dir("phi3_longrope")
    llm = LLM(
        str(model_dir), max_model_len=96, max_num_seqs=4, enforce_eager=True
    )  # prefix caching asked (default)
    long_prompt = [(5 * i + 11) % 4000 + 100 for i in range(45)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    llm.generate([{"prompt_token_ids": long_prompt[:20]}], params, use_tqdm=False)
    (output,) = llm.generate([{"prompt_token_ids": long_prompt}], params, use_tqdm=False)
    tokens, logprobs = hf_greedy(model_dir, long_prompt, 4)
    ours = [step[token].logprob for step, token in zip(output.outputs[0].logprobs, tokens, strict=True)]
    assert ours == pytest.approx(logprobs, abs=2e-5)
    assert not llm.engine.config.enable_prefix_caching
