"""Speculative decoding: proposals verified in one step change nothing a request generates, greedy or sampled (a
draw depends on the seed and the position only), whatever the proposals are, and whatever else the engine does
meanwhile (preemption, prefix hits, parallel samples, stop rules, penalties, grammars); they cost no compilation
and leak no block.

Most tests propose with an oracle: the tokens a run without speculation generated, some of them corrupted, so
both acceptance and rejection happen at every position (a tiny random model seldom repeats itself, so n-gram and
suffix proposals of its text are mostly rejected: those methods are tested on their own below)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from engine_driver import run_requests

from jpaged.config import EngineConfig, SpeculativeConfig
from jpaged.engine.llm_engine import LLMEngine
from jpaged.engine.speculation import MAX_IDLE_STEPS
from jpaged.sampling_params import SamplingParams, StructuredOutputsParams

ARGS = dict(max_num_seqs=16, max_num_batched_tokens=128, max_model_len=256, num_blocks=96, enforce_eager=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = [[(5 * i * i + 17 * i + 3 + 11 * r) % 997 for i in range(20 + 9 * r)] for r in range(4)]


def make(model, spec=None, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(**{**ARGS, **overrides}, speculative_config=spec), model=model)


def generate(engine: LLMEngine, params: SamplingParams, prompts=PROMPTS) -> dict[str, list]:
    outputs = run_requests(engine, {str(i): (prompt, params) for i, prompt in enumerate(prompts)})
    assert engine.blocks.num_free_blocks == engine.blocks.num_total_blocks  # rejected slots leak nothing
    return {key: [list(o.token_ids) for o in out.outputs] for key, out in sorted(outputs.items())}


def oracle(expected: dict[str, list], seed: int = 0, corrupt: float = 0.3):
    """A proposer that knows the output a run without speculation gave, and corrupts each proposal with
    probability `corrupt` at a random position (so every position is both accepted and rejected)."""
    rng = np.random.default_rng(seed)

    def propose(seq, k: int) -> list[int]:
        output = expected[seq.request.request_id][seq.index]
        done = len(seq.output_token_ids)
        drafts = list(output[done : done + k])
        if drafts and rng.random() < corrupt:
            drafts[rng.integers(len(drafts))] = int(rng.integers(1000))
        return drafts

    return propose


def speculated(model, expected, params, prompts=PROMPTS, spec=NGRAM, **overrides) -> tuple[dict, LLMEngine]:
    engine = make(model, spec, **overrides)
    engine.speculation.proposer = oracle(expected)
    return generate(engine, params, prompts), engine


GREEDY = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
SAMPLED = SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, top_p=0.9, seed=7)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_outputs_equal_those_without_speculation_and_most_proposals_are_accepted(tiny_llama, params):
    expected = generate(make(tiny_llama), params)
    got, engine = speculated(tiny_llama, expected, params)
    assert got == expected
    stats = engine.spec_decode_stats()
    assert stats.num_drafts > 20 and 0.5 < stats.acceptance_rate < 1.0
    assert all(count > 0 for count in stats.accepted_per_position)
    assert engine.metrics()["spec_decode_num_accepted_tokens"] == stats.num_accepted_tokens


def test_logprobs_of_accepted_tokens_equal_the_ones_without_speculation(tiny_llama):
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=3, temperature=0.8, seed=3)
    prompts = {str(i): (prompt, params) for i, prompt in enumerate(PROMPTS)}
    base = run_requests(make(tiny_llama, dtype="float32"), prompts)
    engine = make(tiny_llama, NGRAM, dtype="float32")
    engine.speculation.proposer = oracle({k: [list(o.outputs[0].token_ids)] for k, o in base.items()})
    spec = run_requests(engine, prompts)
    assert engine.spec_decode_stats().num_accepted_tokens > 10
    for key, out in base.items():
        want, got = out.outputs[0], spec[key].outputs[0]
        assert got.token_ids == want.token_ids
        for a, b in zip(want.logprobs, got.logprobs, strict=True):
            assert a.keys() == b.keys()
            np.testing.assert_allclose(
                [v.logprob for v in b.values()], [v.logprob for v in a.values()], atol=1e-5
            )
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-4)


def test_the_sampled_distribution_is_the_target_one(tiny_llama):
    """A chi-square test over 3000 draws of a request's first three tokens (top_k 2: eight outcomes), each
    second token proposed as one of its two candidates at random: accepted and resampled draws together must
    follow the target's probabilities, which a run without speculation gives as logprobs."""
    prompt = PROMPTS[1]
    top2 = SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0, top_k=2, logprobs=2)
    probe = make(tiny_llama, dtype="float32", max_num_seqs=8)

    def candidates(prefix: list[int]) -> dict[int, float]:
        """The two tokens top_k keeps after prefix, with their renormalised probabilities."""
        probe.add_request("p", prompt + prefix, SamplingParams(max_tokens=1, logprobs=2))
        out = run_requests(probe, {})["p"].outputs[0].logprobs[0]
        best = sorted(out.items(), key=lambda item: -item[1].logprob)[:2]
        weights = np.exp([lp.logprob for _, lp in best])
        return dict(zip([t for t, _ in best], weights / weights.sum(), strict=True))

    expected = {}
    for a, pa in candidates([]).items():
        second = candidates([a])
        for b, pb in second.items():
            for c, pc in candidates([a, b]).items():
                expected[(a, b, c)] = pa * pb * pc
    rng = np.random.default_rng(0)
    second_of = {a: list(candidates([a])) for a in {key[0] for key in expected}}
    engine = make(
        tiny_llama, NGRAM, dtype="float32", max_num_seqs=64, max_num_batched_tokens=512, num_blocks=512
    )
    engine.speculation.proposer = lambda seq, k: [int(rng.choice(second_of[seq.output_token_ids[0]]))]
    draws = 3000
    for i in range(draws):
        engine.add_request(str(i), prompt, dataclasses.replace(top2, seed=i))
    outputs = run_requests(engine, {})
    counts = {key: 0 for key in expected}
    for out in outputs.values():
        counts[tuple(out.outputs[0].token_ids)] += 1
    stats = engine.spec_decode_stats()
    assert 0.2 < stats.acceptance_rate < 0.8  # both branches taken often
    from scipy.stats import chisquare

    keys = sorted(expected)
    observed = np.array([counts[k] for k in keys])
    want = np.array([expected[k] for k in keys]) * draws
    assert chisquare(observed, want * observed.sum() / want.sum()).pvalue > 1e-3


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_outputs_are_unchanged_by_preemption(tiny_llama, mode):
    prompts = [p * 2 for p in PROMPTS]  # 40 to 94 tokens, 24 more each: 14 blocks cannot hold them all
    expected = generate(make(tiny_llama), GREEDY, prompts)
    got, engine = speculated(
        tiny_llama, expected, GREEDY, prompts, num_blocks=14, max_model_len=128, preemption_mode=mode
    )
    assert got == expected
    assert engine.scheduler.num_preemptions > 0


def test_prefix_hits_after_speculation_reuse_only_accepted_tokens(tiny_llama):
    """A request's full blocks are cached as it goes: a second request whose prompt is the first's prompt and
    output hits them, and generates what it would without speculation (no rejected token's KV is cached)."""
    expected = generate(make(tiny_llama), GREEDY, PROMPTS[:1])
    engine = make(tiny_llama, NGRAM)
    engine.speculation.proposer = oracle(expected)
    assert generate(engine, GREEDY, PROMPTS[:1]) == expected
    follow_up = PROMPTS[0] + expected["0"][0]
    want = generate(make(tiny_llama, enable_prefix_caching=False), GREEDY, [follow_up])
    engine.speculation.proposer = oracle(want)
    hits = engine.blocks.prefix_cache_hits
    assert generate(engine, GREEDY, [follow_up]) == want
    assert engine.blocks.prefix_cache_hits - hits >= 32


def test_parallel_samples_each_speculate(tiny_llama):
    params = SamplingParams(n=3, max_tokens=16, ignore_eos=True, temperature=1.0, seed=11)
    expected = generate(make(tiny_llama), params, PROMPTS[:2])
    got, engine = speculated(tiny_llama, expected, params, PROMPTS[:2])
    assert got == expected
    assert engine.spec_decode_stats().num_accepted_tokens > 0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(
            max_tokens=11, ignore_eos=True, temperature=0.0
        ),  # the length limit falls inside a proposal
        SamplingParams(max_tokens=24, temperature=1.0, seed=5, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(max_tokens=24, temperature=1.0, seed=5, min_tokens=6, bad_words=["the"]),
    ],
    ids=["max_tokens", "penalties", "min_tokens_and_bad_words"],
)
def test_stop_rules_and_history_dependent_sampling_hold_mid_proposal(tiny_llama, params):
    expected = generate(make(tiny_llama), params)
    got, _ = speculated(tiny_llama, expected, params)
    assert got == expected


def test_a_stop_token_inside_an_accepted_proposal_ends_the_request_there(tiny_llama):
    free = generate(make(tiny_llama), GREEDY, PROMPTS[:1])["0"][0]
    params = SamplingParams(max_tokens=24, stop_token_ids=[free[6]], temperature=0.0)
    expected = generate(make(tiny_llama), params, PROMPTS[:1])
    assert len(expected["0"][0]) <= 7
    got, _ = speculated(tiny_llama, {"0": [free]}, params, PROMPTS[:1])
    assert got == expected


def test_structured_outputs_mask_every_proposed_position(tiny_llama):
    params = SamplingParams(
        max_tokens=24,
        temperature=1.0,
        seed=2,
        structured_outputs=StructuredOutputsParams(regex="[a-z ]{5,40}"),
    )
    expected = generate(make(tiny_llama), params)
    got, engine = speculated(tiny_llama, expected, params)
    assert got == expected
    assert engine.spec_decode_stats().num_accepted_tokens > 0


@pytest.mark.parametrize(
    "spec",
    [NGRAM, {"method": "suffix", "num_speculative_tokens": 4}],
    ids=["ngram", "suffix"],
)
def test_each_method_leaves_outputs_unchanged(tiny_llama, spec):
    """Outputs restricted to a prompt's ten tokens, so the text repeats itself and proposals find matches."""
    prompts = [p[:10] * 3 for p in PROMPTS]
    for params in (GREEDY, SAMPLED):
        params = dataclasses.replace(params, allowed_token_ids=sorted(set(PROMPTS[0][:10])), max_tokens=40)
        expected = generate(make(tiny_llama), params, prompts)
        engine = make(tiny_llama, spec)
        assert generate(engine, params, prompts) == expected
        stats = engine.spec_decode_stats()
        assert stats.num_drafts > 10 and stats.num_accepted_tokens > 0


def test_speculation_steps_aside_for_a_large_batch(tiny_llama):
    engine = make(tiny_llama, {**NGRAM, "disable_by_batch_size": 4})
    engine.speculation.proposer = lambda seq, k: [1] * k
    generate(engine, GREEDY, PROMPTS)  # four at once: no proposal until one has finished
    assert engine.spec_decode_stats().num_drafts == 0
    generate(engine, GREEDY, PROMPTS[:3])
    assert engine.spec_decode_stats().num_drafts > 0


def test_proposals_that_never_pay_pause(tiny_llama):
    engine = make(tiny_llama, NGRAM)
    engine.speculation.proposer = lambda seq, k: [0] * k  # never the model's token
    generate(engine, SamplingParams(max_tokens=60, ignore_eos=True, temperature=0.0), PROMPTS[:1])
    assert engine.spec_decode_stats().num_drafts < 20


def test_a_batch_without_proposals_keeps_async_overlap_and_tries_again_backing_off(tiny_llama):
    """Proposing needs each sequence's latest token, which waits for the step in flight: after steps where no
    sequence had a proposal, 0, 1, 3, 7, 7, ... steps overlap as without speculation before the next try."""
    engine = make(tiny_llama, NGRAM, async_scheduling=True)
    tries = []
    engine.speculation.proposer = lambda seq, k: tries.append(len(seq.output_token_ids)) or []
    generate(engine, SamplingParams(max_tokens=41, ignore_eos=True, temperature=0.0), PROMPTS[:1])
    gaps = np.diff(tries).tolist()
    assert gaps[:4] == [1, 2, 4, 8] and set(gaps[4:]) == {MAX_IDLE_STEPS + 1}


def test_verification_compiles_nothing_after_warm_up(tiny_llama):
    engine = make(tiny_llama, NGRAM, enforce_eager=False, max_num_seqs=8, max_num_batched_tokens=64)
    expected = generate(make(tiny_llama), SAMPLED)
    engine.speculation.proposer = oracle(expected)
    compiled = engine.runner.num_compilations
    assert generate(engine, SAMPLED) == expected
    assert engine.runner.num_compilations == compiled


def test_the_config_takes_vllm_keys_and_refuses_what_it_cannot_run():
    config = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')
    assert config.speculative_config == SpeculativeConfig(
        "ngram", 4, prompt_lookup_min=5, prompt_lookup_max=5
    )
    assert SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}) == (
        SpeculativeConfig("ngram", 2, prompt_lookup_min=3, prompt_lookup_max=3)
    )
    for bad, message in [
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "<=",
        ),
        ({"method": "medusa", "num_speculative_tokens": 2}, "'medusa' is not supported yet"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "a draft model needs 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, r"unknown keys \['typo'\]"),
        ("{not json", "not valid JSON"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(speculative_config=bad)
    with pytest.raises(ValueError, match="pooling model"):
        EngineConfig(speculative_config=NGRAM, convert="embed")


def draft_engine(model, draft_dir, k: int = 3, **overrides) -> LLMEngine:
    return make(model, {"model": str(draft_dir), "num_speculative_tokens": k}, **overrides)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_draft_model_of_the_same_weights_proposes_the_targets_own_greedy_tokens(
    tiny_llama, tiny_llama_dir, params
):
    """The target as its own draft: greedy, nearly every proposal is accepted (so the draft's KV, kept up step
    by step on the target's blocks, is right); sampled, outputs are still exactly the target's."""
    expected = generate(make(tiny_llama), params)
    engine = draft_engine(tiny_llama, tiny_llama_dir)
    assert engine.speculation.spec.method == "draft_model"
    assert generate(engine, params) == expected
    stats = engine.spec_decode_stats()
    assert stats.num_drafts > 10
    if params.temperature == 0:
        assert stats.acceptance_rate > 0.9


def test_a_draft_model_of_another_family_changes_nothing_under_preemption_and_parallel_samples(
    tiny_llama, tiny_model_dir
):
    draft_dir = tiny_model_dir("qwen3_qk_norm")
    prompts = [p * 2 for p in PROMPTS]
    expected = generate(make(tiny_llama), GREEDY, prompts)
    engine = draft_engine(tiny_llama, draft_dir, num_blocks=14, max_model_len=128)
    assert generate(engine, GREEDY, prompts) == expected
    assert engine.scheduler.num_preemptions > 0 and engine.spec_decode_stats().num_drafts > 0
    params = SamplingParams(n=3, max_tokens=12, ignore_eos=True, temperature=1.0, seed=11)
    assert generate(draft_engine(tiny_llama, draft_dir), params, PROMPTS[:2]) == generate(
        make(tiny_llama), params, PROMPTS[:2]
    )


def test_a_draft_model_compiles_nothing_after_warm_up(tiny_llama, tiny_llama_dir):
    engine = draft_engine(
        tiny_llama, tiny_llama_dir, enforce_eager=False, max_num_seqs=8, max_num_batched_tokens=64
    )
    compiled = engine.runner.num_compilations, engine.draft.runner.num_compilations
    assert generate(engine, SAMPLED) == generate(make(tiny_llama), SAMPLED)
    assert (engine.runner.num_compilations, engine.draft.runner.num_compilations) == compiled


def test_a_draft_model_of_another_vocabulary_or_with_swapping_is_refused(
    tiny_llama, tiny_model_dir, tmp_path
):
    with pytest.raises(ValueError, match="preemption_mode 'recompute'"):
        make(tiny_llama, {"model": "/any", "num_speculative_tokens": 2}, preemption_mode="swap")
    import transformers

    other = transformers.LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(other).save_pretrained(tmp_path / "small")
    transformers.AutoTokenizer.from_pretrained(tiny_model_dir("llama")).save_pretrained(tmp_path / "small")
    with pytest.raises(
        ValueError, match=r"draft's vocabulary \(1000 tokens\) must be the target's \(49152\)"
    ):
        draft_engine(tiny_llama, tmp_path / "small")
