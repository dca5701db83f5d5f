"""Mixtures of experts through the engine (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral, gpt-oss): greedy
generation follows transformers token for token, with logprobs within 1e-4, for prompts of several lengths
prefilled in chunks, from a cached prefix, under preemption and with async scheduling; and whatever the routing
does (the experts' group sizes are data), nothing compiles after warm-up."""

from __future__ import annotations

import pytest
from greedy import assert_same_greedy, hf_greedy

from jpaged import LLM, SamplingParams

# Chunks of 16 tokens, so the 45-token prompt is prefilled in three steps.
ARGS = dict(max_model_len=96, max_num_batched_tokens=16, max_num_seqs=4)
PROMPTS = [[(7 * i + 3) % 4000 + 100 for i in range(n)] for n in (3, 45, 17, 30)]


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 12) -> list:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def tokens_of(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"])
def moe(request, tiny_model_dir):
    model_dir = tiny_model_dir(request.param)
    return model_dir, LLM(str(model_dir), **ARGS, async_scheduling=False)


def assert_follows_transformers(model_dir, outputs, label: str) -> None:
    for output in outputs:
        completion = output.outputs[0]
        tokens, logprobs = hf_greedy(model_dir, output.prompt_token_ids, len(completion.token_ids))
        assert_same_greedy(completion, tokens, label)
        ours = [step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)]
        assert ours == pytest.approx(logprobs, abs=1e-4), label


def test_greedy_follows_transformers_in_chunks_and_from_a_cached_prefix(moe):
    model_dir, llm = moe
    assert_follows_transformers(model_dir, greedy(llm, PROMPTS), f"{model_dir.name}, fresh")
    hits = llm.metrics()["prefix_cache_hits"]
    (extended,) = greedy(llm, [PROMPTS[1] + [500, 501, 502, 503, 504]])  # its first 32 tokens are cached
    assert llm.metrics()["prefix_cache_hits"] > hits
    assert_follows_transformers(model_dir, [extended], f"{model_dir.name}, cached prefix")


def test_async_scheduling_and_preemption_keep_every_greedy_output(moe):
    model_dir, llm = moe
    expected = tokens_of(greedy(llm, PROMPTS))
    overlapped = LLM(str(model_dir), **ARGS, async_scheduling=True)
    assert tokens_of(greedy(overlapped, PROMPTS)) == expected
    # 8 blocks of 16 for four sequences of up to 57 tokens: they cannot all run at once.
    tight = LLM(str(model_dir), **ARGS, num_blocks=8, async_scheduling=True, enforce_eager=True)
    assert tokens_of(greedy(tight, PROMPTS)) == expected
    assert tight.metrics()["num_preemptions"] > 0


def test_nothing_compiles_after_warm_up_whatever_the_routing(moe):
    """Sampling sends the tokens to experts greedy decoding never picks, batches of one to four rows fill the
    groups unevenly: the step's shapes are the token bucket's, whatever the group sizes."""
    _, llm = moe
    compiled = llm.metrics()["num_compilations"]
    params = [
        SamplingParams(max_tokens=6, temperature=1.5, seed=seed, n=1 + seed % 3, logprobs=1)
        for seed in range(4)
    ]
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    greedy(llm, PROMPTS[:1], max_tokens=20)
    llm.beam_search([{"prompt_token_ids": PROMPTS[2]}], beam_width=3, max_tokens=4)
    assert llm.metrics()["num_compilations"] == compiled
