"""The on-device sampler: truncation never leaks, frequencies match, vLLM's penalties, reproducible seeds."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from sampler_harness import WIDTHS, V, jitted_sample, rows_of, with_neutral_wide
from scipy import stats

from jpaged.runner.sampler import (
    _candidate_threshold,
    _LogWeights,
    _top_k_top_p_threshold,
    apply_penalties,
    argmax_rows,
)
from jpaged.runner.sampling_inputs import SamplingRow, build_sampling_tensors
from jpaged.sampling_params import MAX_LOGPROBS, SamplingParams

DRAWS = 4096
LIVE = np.random.default_rng(0).choice(V, 32, replace=False)  # the tokens with probability, spread over V
LOGITS = np.full(V, -np.inf, np.float32)
LOGITS[LIVE] = np.random.default_rng(1).normal(0.0, 2.0, 32)


def _run(rows: list[SamplingRow], logits: np.ndarray, branch_free=False, truncation=True):
    """Sample with every batch padded to DRAWS rows, so the tests share a few compilations."""
    logits = np.zeros((DRAWS, V), np.float32) + (
        logits if logits.ndim == 1 else np.pad(logits, [(0, DRAWS - len(logits)), (0, 0)])
    )
    tensors = build_sampling_tensors(rows, DRAWS, WIDTHS, truncation=truncation)
    sampled = jitted_sample(logits, with_neutral_wide(tensors), branch_free=branch_free)
    out = jax.tree.map(np.asarray, sampled)
    return jax.tree.map(lambda x: x[: len(rows)], out), tensors


def _softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def _assert_frequencies_match(tokens: np.ndarray, probs: np.ndarray) -> None:
    """Tokens only from the support of probs, and counts pass a chi-square test against probs."""
    support = probs > 0
    assert support[tokens].all(), f"sampled outside the allowed set: {sorted(set(tokens[~support[tokens]]))}"
    counts = np.bincount(tokens, minlength=len(probs))[support]
    expected = probs[support] / probs[support].sum() * len(tokens)
    assert stats.chisquare(counts, expected).pvalue > 1e-3


def _truncated(probs: np.ndarray, keep: np.ndarray) -> np.ndarray:
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def test_temperature_zero_equals_argmax():
    logits = np.random.default_rng(1).normal(size=(8, V)).astype(np.float32)
    rows = rows_of(SamplingParams(temperature=0.0), 5)
    out, _ = _run(rows, logits)
    np.testing.assert_array_equal(out.token_ids, logits[:5].argmax(-1))


@pytest.mark.parametrize("vocab_size", [49152, 1000, 151936, 997])
def test_the_two_level_argmax_is_numpys_first_maximum_with_ties_and_inf(vocab_size):
    rng = np.random.default_rng(vocab_size)
    x = rng.normal(size=(12, vocab_size)).astype(np.float32)
    x[1] = -np.inf  # every entry the same: the first
    x[2, rng.integers(vocab_size, size=3)] = 50.0  # tied maxima in different blocks: the first
    x[3, [7, 8]] = np.inf
    x[4, [vocab_size - 1, 3]] = -np.inf
    x[5] = np.round(x[5])  # many ties
    x[6, -1] = 99.0  # the last entry
    np.testing.assert_array_equal(jax.jit(argmax_rows)(x), x.argmax(-1))


def test_greedy_rows_take_argmax_inside_a_sampled_batch():
    logits = np.random.default_rng(2).normal(size=(8, V)).astype(np.float32)
    rows = [SamplingRow(SamplingParams(temperature=0.0 if i % 2 else 1.0), [1], [], seed=i) for i in range(8)]
    out, _ = _run(rows, logits)
    np.testing.assert_array_equal(out.token_ids[1::2], logits[1::2].argmax(-1))


def test_plain_temperature_sampling_matches_softmax():
    out, _ = _run(rows_of(SamplingParams(temperature=0.7), DRAWS), LOGITS)
    _assert_frequencies_match(out.token_ids, _softmax(LOGITS / 0.7))


def test_top_k_samples_only_the_k_best_in_proportion():
    out, _ = _run(rows_of(SamplingParams(top_k=5), DRAWS), LOGITS)
    keep = np.sort(LOGITS)[-5] <= LOGITS
    _assert_frequencies_match(out.token_ids, _truncated(_softmax(LOGITS), keep))


def _top_p_keep(probs: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(-probs)
    ahead = np.cumsum(probs[order]) - probs[order]
    keep = np.zeros(len(probs), bool)
    keep[order[ahead < top_p]] = True
    return keep


def test_top_p_samples_only_the_smallest_head_reaching_p():
    probs = _softmax(LOGITS)
    keep = _top_p_keep(probs, 0.6)
    assert 1 < keep.sum() < V  # the test truncates something and still samples
    out, _ = _run(rows_of(SamplingParams(top_p=0.6), DRAWS), LOGITS)
    _assert_frequencies_match(out.token_ids, _truncated(probs, keep))


def test_min_p_drops_tokens_below_fraction_of_the_best():
    probs = _softmax(LOGITS / 0.8)
    keep = probs >= 0.1 * probs.max()
    assert 1 < keep.sum() < V
    out, _ = _run(rows_of(SamplingParams(temperature=0.8, min_p=0.1), DRAWS), LOGITS)
    _assert_frequencies_match(out.token_ids, _truncated(probs, keep))


def test_top_k_then_top_p_apply_top_p_to_the_renormalised_top_k():
    probs = _softmax(LOGITS)
    top_k = _truncated(probs, np.sort(LOGITS)[-8] <= LOGITS)
    expected = _truncated(top_k, _top_p_keep(top_k, 0.8))
    assert 1 < (expected > 0).sum() < (_top_p_keep(probs, 0.8) & (top_k > 0)).sum()  # renormalising matters
    out, _ = _run(rows_of(SamplingParams(top_k=8, top_p=0.8), DRAWS), LOGITS)
    _assert_frequencies_match(out.token_ids, expected)


def test_same_seed_same_token_regardless_of_row_or_batch():
    logits = np.zeros(V, np.float32)  # uniform: any dependence on the row would show
    params = SamplingParams(temperature=1.0)
    rows = rows_of(params, 16)
    alone, _ = _run(rows, logits)
    mixed_in = [SamplingRow(SamplingParams(top_k=3), [5], [], seed=7), *reversed(rows)]
    shuffled, _ = _run(mixed_in, logits)
    np.testing.assert_array_equal(shuffled.token_ids[1:17][::-1], alone.token_ids)
    assert len(set(alone.token_ids.tolist())) > 4  # different seeds give different draws


def test_top_k_top_p_switched_on_but_unused_draw_like_the_plain_path():
    rows = rows_of(SamplingParams(), 64)
    plain, tensors = _run(rows, LOGITS, truncation=False)
    assert tensors.top_k is None  # what the branch-free host sends when no row truncates
    carried = tensors._replace(top_k=np.zeros(DRAWS, np.int32), top_p=np.ones(DRAWS, np.float32))
    out = jitted_sample(np.broadcast_to(LOGITS, (DRAWS, V)), with_neutral_wide(carried))
    np.testing.assert_array_equal(np.asarray(out.token_ids)[:64], plain.token_ids)


@pytest.mark.parametrize("top_k", [V, 2**31, 2**63])
def test_a_top_k_past_the_vocabulary_keeps_every_token(top_k):
    """Any int a client sends for top_k packs (no overflow) and draws like top_k off."""
    off, _ = _run(rows_of(SamplingParams(top_p=0.9), 64), LOGITS)
    huge, _ = _run(rows_of(SamplingParams(top_p=0.9, top_k=top_k), 64), LOGITS)
    np.testing.assert_array_equal(huge.token_ids, off.token_ids)


def test_draw_advances_with_the_number_of_generated_tokens():
    logits = np.zeros(V, np.float32)
    first, _ = _run(rows_of(SamplingParams(), 64), logits)
    later, _ = _run(rows_of(SamplingParams(), 64, outputs=[9]), logits)
    assert (first.token_ids != later.token_ids).mean() > 0.8  # ~31/32 expected for a uniform draw


def _vllm_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM's apply_penalties (model_executor/layers/utils.py), one row, transcribed in numpy."""
    logits = logits.astype(np.float64).copy()
    counts = np.bincount(np.asarray(output, int), minlength=len(logits))
    seen = counts > 0
    seen[np.asarray(prompt, int)] = True
    rep = np.where(seen, repetition, 1.0)
    logits = np.where(logits > 0, logits / rep, logits * rep)
    logits -= frequency * counts
    logits -= presence * (counts > 0)
    return logits


@pytest.mark.parametrize(
    ("presence", "frequency", "repetition"),
    [(0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.0, 0.0, 1.3), (0.4, -0.3, 0.8)],
)
def test_penalties_change_logits_as_vllm_defines(presence, frequency, repetition):
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, V)).astype(np.float32)
    prompts = [rng.integers(0, V, n).tolist() for n in (3, 7, 1, 12)]
    outputs = [rng.integers(0, V, n).tolist() for n in (5, 0, 9, 2)]
    params = SamplingParams(
        presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition
    )
    rows = [SamplingRow(params, p, o, seed=0) for p, o in zip(prompts, outputs, strict=True)]
    t = build_sampling_tensors(rows, 4, WIDTHS)
    got = np.asarray(
        jax.jit(apply_penalties)(
            logits, t.history, t.prompt_lens, t.presence_penalty, t.frequency_penalty, t.repetition_penalty
        )
    )
    for i in range(4):
        want = _vllm_penalties(logits[i], prompts[i], outputs[i], presence, frequency, repetition)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)


def test_repetition_penalty_steers_greedy_away_from_repeats():
    logits = np.zeros(V, np.float32)
    logits[4], logits[5] = 2.0, 1.9
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    out, _ = _run([SamplingRow(params, [4], [], seed=0)], logits)
    assert out.token_ids[0] == 5


def test_logprobs_are_log_softmax_of_raw_logits_with_top_k_and_rank():
    logits = np.random.default_rng(4).normal(size=(8, V)).astype(np.float32)
    params = SamplingParams(temperature=0.5, frequency_penalty=1.0, logprobs=3)
    out, _ = _run(rows_of(params, 8, outputs=[1, 2]), logits)
    raw = np.asarray(jax.nn.log_softmax(logits.astype(np.float64), axis=-1))
    rows_idx = np.arange(8)
    np.testing.assert_array_equal(out.logprob_token_ids[:, 0], out.token_ids)
    np.testing.assert_allclose(out.logprobs[:, 0], raw[rows_idx, out.token_ids], atol=1e-5)
    # Every step computes the top MAX_LOGPROBS; the host keeps each row's own number of them.
    np.testing.assert_array_equal(out.logprob_token_ids[:, 1:], np.argsort(-raw, axis=-1)[:, :MAX_LOGPROBS])
    np.testing.assert_allclose(out.logprobs[:, 1:], -np.sort(-raw, axis=-1)[:, :MAX_LOGPROBS], atol=1e-5)
    ranks = (raw >= raw[rows_idx, out.token_ids][:, None]).sum(-1)
    np.testing.assert_array_equal(out.sampled_rank, ranks)


def test_logprobs_are_skipped_when_no_row_asks():
    out, _ = _run(rows_of(SamplingParams(), 2), LOGITS)
    assert out.logprobs.shape == (2, 1 + MAX_LOGPROBS) and not out.logprobs.any()
    assert not out.sampled_rank.any()


def test_allowed_token_ids_restrict_only_their_row():
    allowed = [3, 9, 17]
    rows = [
        *rows_of(SamplingParams(allowed_token_ids=allowed), DRAWS - 1),
        SamplingRow(SamplingParams(), [1], [], 5),
    ]
    logits = np.zeros(V, np.float32)
    out, _ = _run(rows, logits)
    _assert_frequencies_match(out.token_ids[:-1], np.isin(np.arange(V), allowed) / 3.0)
    greedy_unrestricted, _ = _run([SamplingRow(SamplingParams(temperature=0.0), [1], [], 0)], LOGITS)
    assert greedy_unrestricted.token_ids[0] == LOGITS.argmax()


def test_logit_bias_adds_to_the_logits():
    target = int(LIVE[np.argmin(LOGITS[LIVE])])
    params = SamplingParams(temperature=0.0, logit_bias={target: 100.0})
    out, _ = _run([SamplingRow(params, [1], [], 0)], LOGITS)
    assert out.token_ids[0] == target
    params = SamplingParams(temperature=0.0, logit_bias={int(np.argmax(LOGITS)): -100.0})
    out, _ = _run([SamplingRow(params, [1], [], 0)], LOGITS)
    assert out.token_ids[0] == np.argsort(LOGITS)[-2]


def test_bad_words_ban_single_tokens_and_completions_of_a_generated_prefix():
    best, second = (int(i) for i in np.argsort(LOGITS)[::-1][:2])
    params = SamplingParams(temperature=0.0)
    single = SamplingRow(params, [1], [], 0, bad_words_token_ids=[[best]])
    prefixed = SamplingRow(params, [1], [7], 0, bad_words_token_ids=[[7, best]])
    other_prefix = SamplingRow(params, [1], [8], 0, bad_words_token_ids=[[7, best]])
    out, _ = _run([single, prefixed, other_prefix], LOGITS)
    assert out.token_ids.tolist() == [second, second, best]


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    eos, stop = (int(i) for i in np.argsort(LOGITS)[::-1][:2])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[stop])
    early = SamplingRow(params, [1], [0], 0, eos_token_id=eos)
    done = SamplingRow(params, [1], [0, 0], 0, eos_token_id=eos)
    out, _ = _run([early, done], LOGITS)
    assert out.token_ids[0] not in (eos, stop)
    assert out.token_ids[1] == eos


def _reference_kept(logits: np.ndarray, top_k: int, top_p: float) -> int:
    """How many tokens vLLM keeps: top_k (ties kept), then top_p over the renormalised rest, by full sort."""
    values = np.sort(logits.astype(np.float64))[::-1]
    probs = _softmax(values)
    k = top_k if top_k > 0 else len(values)
    kept = values >= values[k - 1]
    probs = np.where(kept, probs, 0.0) / probs[kept].sum()
    ahead = np.cumsum(probs) - probs
    return int(min(kept.sum(), (ahead < top_p).sum() if top_p < 1 else len(values)))


def test_truncation_uses_few_candidates_when_they_decide_and_bisects_otherwise():
    big_v = 8192  # candidate tiers 256 and 4096, then the full sort
    rng = np.random.default_rng(6)
    peaked = rng.normal(0.0, 4.0, (3, big_v))
    flat = rng.normal(0.0, 0.1, (3, big_v))
    logits = np.concatenate([peaked, flat]).astype(np.float32)
    top_k = np.array([10, 0, 0, 0, 1000, 6000], np.int32)
    top_p = np.array([1.0, 0.5, 1.0, 0.9, 0.95, 0.99], np.float32)
    peak = logits.max(-1)
    cut = _LogWeights(peak, np.ones(6, np.float32), np.full(6, -np.inf, np.float32))
    mass = np.exp(logits - peak[:, None]).sum(-1)

    @jax.jit  # one compilation for the probes, the tiered search and the branch-free sort
    def probe(logits, cut, mass, top_k, top_p):
        decided = [_candidate_threshold(logits, cut, mass, top_k, top_p, n)[1] for n in (256, 4096)]
        tiered = _top_k_top_p_threshold(logits, cut, top_k, top_p)
        return decided, tiered, _top_k_top_p_threshold(logits, cut, top_k, top_p, branch_free=True)

    (decided_256, decided_4096), tiered, sorted_ = probe(logits, cut, mass, top_k, top_p)
    assert np.asarray(decided_256).tolist() == [True, True, True, False, False, False]
    assert np.asarray(decided_4096).tolist() == [True, True, True, False, True, False]
    expected = [_reference_kept(row, k, p) for row, k, p in zip(logits, top_k, top_p, strict=True)]
    for threshold in (tiered, sorted_):
        kept = (logits - peak[:, None] >= np.asarray(threshold)[:, None]).sum(-1)
        assert kept.tolist() == expected


def test_the_branch_free_sampler_draws_what_the_branching_one_draws():
    """Accelerators' form (no lax.cond) against the CPU's, row for row on one batch of every kind of row."""
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7),
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.6),
        SamplingParams(temperature=0.8, min_p=0.1),
        SamplingParams(top_k=8, top_p=0.8),
    ]
    rows = [row for params in kinds for row in rows_of(params, 64)]
    logits = np.random.default_rng(7).normal(0.0, 2.0, (len(rows), V)).astype(np.float32)
    branching, _ = _run(rows, logits)
    branch_free, _ = _run(rows, logits, branch_free=True)
    assert (branching.token_ids == branch_free.token_ids).all()
    assert (branch_free.token_ids[:64] == logits[:64].argmax(-1)).all()
