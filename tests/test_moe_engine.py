"""Mixtures of experts through the engine (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral, gpt-oss): greedy
generation follows transformers token for token, with logprobs within 1e-4, for prompts of several lengths
prefilled in chunks, from a cached prefix, under preemption and with async scheduling; and whatever the routing
does (the experts' group sizes are data), nothing compiles after warm-up; the experts' load is a Prometheus
histogram."""

from __future__ import annotations

import pytest
from greedy import assert_follows_transformers, generate_greedy, tokens_of
from jpaged_server.metrics import expert_load_family
from prometheus_client import CollectorRegistry, generate_latest

from jpaged import LLM, SamplingParams
from jpaged.engine.engine_metrics import ExpertLoad

# Chunks of 16 tokens, so the 45-token prompt is prefilled in three steps.
ARGS = dict(max_model_len=96, max_num_batched_tokens=16, max_num_seqs=4)
PROMPTS = [[(7 * i + 3) % 4000 + 100 for i in range(n)] for n in (3, 45, 17, 30)]


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"])
def moe(request, tiny_model_dir):
    model_dir = tiny_model_dir(request.param)
    return model_dir, LLM(str(model_dir), **ARGS, async_scheduling=False)


def test_greedy_follows_transformers_in_chunks_and_from_a_cached_prefix(moe):
    model_dir, llm = moe
    assert_follows_transformers(
        model_dir, generate_greedy(llm, PROMPTS, 12), f"{model_dir.name}, fresh", 1e-4
    )
    hits = llm.metrics()["prefix_cache_hits"]
    (extended,) = generate_greedy(
        llm, [PROMPTS[1] + [500, 501, 502, 503, 504]], 12
    )  # its first 32 tokens are cached
    assert llm.metrics()["prefix_cache_hits"] > hits
    assert_follows_transformers(model_dir, [extended], f"{model_dir.name}, cached prefix", 1e-4)


def test_async_scheduling_and_preemption_keep_every_greedy_output(moe):
    model_dir, llm = moe
    if model_dir.name not in ("qwen2_moe", "gpt_oss"):  # the shared expert; biases and sinks
        pytest.skip("the loop's overlap and preemption do not depend on the family: two families check them")
    expected = tokens_of(generate_greedy(llm, PROMPTS, 12))
    overlapped = LLM(str(model_dir), **ARGS, async_scheduling=True)
    assert tokens_of(generate_greedy(overlapped, PROMPTS, 12)) == expected
    # 8 blocks of 16 for four sequences of up to 57 tokens: they cannot all run at once.
    tight = LLM(str(model_dir), **ARGS, num_blocks=8, async_scheduling=True, enforce_eager=True)
    assert tokens_of(generate_greedy(tight, PROMPTS, 12)) == expected
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
    generate_greedy(llm, PROMPTS[:1], 20)
    llm.beam_search([{"prompt_token_ids": PROMPTS[2]}], beam_width=3, max_tokens=4)
    assert llm.metrics()["num_compilations"] == compiled


def test_the_expert_load_histogram_counts_every_routed_token_of_every_layer(moe):
    """Each (layer, expert) of a step is one observation of the tokens it took: over a generate, the observations
    add up to every computed token times top-k times the layers, and come in whole steps of L x E."""
    _, llm = moe
    config = llm.engine.model_config
    before = llm.engine.expert_load()
    prompts = [[3000 + 11 * i + j for j in range(n)] for i, n in enumerate((9, 21))]  # fresh: nothing cached
    max_tokens = 5
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    after = llm.engine.expert_load()
    computed = sum(len(p) + max_tokens - 1 for p in prompts)  # the last sampled token is never fed back
    per_token = config.num_experts_per_tok * config.num_layers
    assert after.total - before.total == computed * per_token
    observations = sum(after.counts) - sum(before.counts)
    assert observations > 0 and observations % (config.num_layers * config.num_experts) == 0
    assert after.buckets == before.buckets and len(after.counts) == len(after.buckets) + 1


def test_the_server_exports_the_expert_load_as_a_prometheus_histogram():
    load = ExpertLoad((0, 1, 2, 4))
    load.add(
        [3, 0, 5, 1, 2, 23]
    )  # a step: 3 experts idle, 5 with two tokens, 1 with 3 or 4, 2 past 4; 23 pairs
    load.add([1, 1, 0, 0, 0, 1])

    class Exported:
        def collect(self):
            yield expert_load_family(load, "tiny")

    registry = CollectorRegistry()
    registry.register(Exported())
    text = generate_latest(registry).decode()
    for le, cumulative in (("0.0", 4), ("1.0", 5), ("2.0", 10), ("4.0", 11), ("+Inf", 13)):
        assert f'jpaged:moe_expert_tokens_bucket{{le="{le}",model_name="tiny"}} {cumulative}.0' in text
    assert 'jpaged:moe_expert_tokens_sum{model_name="tiny"} 24.0' in text
    assert 'jpaged:moe_expert_tokens_count{model_name="tiny"} 13.0' in text
