"""On-device sampling with per-row parameters, so one compiled step mixes greedy and sampled requests.

Shapes: S rows (padded batch), V vocabulary, H token-history width, B logit-bias entries per row, W bitmask words
per row, K = MAX_LOGPROBS top logprobs.

Stages, in vLLM v1's order: the token bitmask (allowed_token_ids, bad words, min_tokens, structured outputs) and
logit_bias -> penalties (repetition on prompt+output, frequency and presence on output) -> temperature -> min_p
-> top_k -> top_p -> draw. Logprobs are of the raw logits (vLLM's "raw_logprobs"); a beam search's rows take
their top K after the bitmask (its grammar's disallowed tokens at -inf), the proposals of a constrained search.

One program per shape: every input is present with a fixed shape (sampling_inputs.py), and a stage no row needs
is skipped at run time, by `lax.cond` on a predicate read off the inputs (no row restricted, biased, penalised,
asking for logprobs, sampling or truncating), so the common path does no extra work; where no row is restricted,
biased or penalised, one cond takes the whole sampling onto the raw logits (a stage's skip branch handing them
back would copy them). The engine warms up nothing but the shapes.

Branch-free (`branch_free=True`, what GPUs and TPUs run): no lax.cond, whose predicate XLA:GPU reads back to the
host and which breaks its command buffers. Every stage runs on its neutral inputs where unused (every token
allowed, zero bias, zero penalties), every row is drawn for and greedy rows take their argmax instead, and top_k/
top_p come from one sort of the rows (fast on an accelerator); the host leaves top_k/top_p out when no row
truncates, so that choice is a variant it makes (two programs per shape).

Randomness: a row's key is fold_in(key(seed), tokens generated so far), so a draw depends only on the request's
seed and position, never on its row or the batch. The draw is a two-level inverse CDF with two uniforms per row
(cheaper on CPU than a Gumbel draw per vocabulary entry). top_k/top_p find their cut-off among the few best
logits (lax.top_k), falling back to more candidates and finally an exact bisection only when those cannot
decide; nothing sorts V (XLA's sort of [S, V] takes seconds on CPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jpaged.runner.sampling_inputs import SamplerOutput, SamplingTensors
from jpaged.sampling_params import MAX_LOGPROBS, SAMPLING_EPS

TRUNCATION_CANDIDATES = (256, 4096)  # top_k/top_p look at this many best logits before bisecting
VOCAB_BLOCK = 256  # the longest block of the two-level passes over a row (inverse-CDF draw, argmax)
_NEG_INF_BITS = 0x7F800000  # float32 bits of +inf: -bitcast(this) is -inf


def _scatter_rows(ids: jax.Array, values: jax.Array | float, vocab_size: int, dtype, op: str) -> jax.Array:
    """Dense [S, V] from per-row sparse ids; id V (padding) lands in a dropped extra column."""
    dense = jnp.zeros((ids.shape[0], vocab_size + 1), dtype)
    rows = jnp.arange(ids.shape[0])[:, None]
    return getattr(dense.at[rows, ids], op)(values)[:, :vocab_size]


def _vocab_blocks(x: jax.Array) -> jax.Array:
    """[S, V] as [S, V / b, b] blocks, b the largest power of two dividing V, at most VOCAB_BLOCK (slicing off a
    remainder would copy the row)."""
    num_rows, vocab_size = x.shape
    block = min(VOCAB_BLOCK, vocab_size & -vocab_size)
    return x.reshape(num_rows, vocab_size // block, block)


def argmax_rows(x: jax.Array) -> jax.Array:
    """int32[S]: jnp.argmax(x, axis=-1) of [S, V] (the first of a row's maxima), in two levels: the blocks' maxima,
    then the best block's argmax. XLA's CPU argmax over a row is an unvectorised loop (~15x slower at [64, 49152],
    scripts/KERNELS.md); plain max reductions are not. Only a row holding NaN may differ: XLA:CPU's max passes NaN
    by, where argmax takes the first NaN; a NaN-aware max measured as slow as argmax, and NaN logits are garbage."""
    blocks = _vocab_blocks(x)
    block = blocks.shape[-1]
    best_block = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
    within = jnp.take_along_axis(blocks, best_block[:, None, None], axis=1)[:, 0]
    return (best_block * block + jnp.argmax(within, axis=-1)).astype(jnp.int32)


def apply_penalties(
    logits: jax.Array,
    history: jax.Array,
    prompt_lens: jax.Array,
    presence_penalty: jax.Array,
    frequency_penalty: jax.Array,
    repetition_penalty: jax.Array,
) -> jax.Array:
    """vLLM's apply_penalties: repetition over prompt+output tokens, frequency and presence over output only."""
    vocab_size = logits.shape[-1]
    is_output = jnp.arange(history.shape[1])[None, :] >= prompt_lens[:, None]
    output_counts = _scatter_rows(history, is_output.astype(jnp.int32), vocab_size, jnp.int32, "add")
    seen = _scatter_rows(history, True, vocab_size, jnp.bool_, "set")
    repetition = jnp.where(seen, repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / repetition, logits * repetition)
    logits = logits - frequency_penalty[:, None] * output_counts
    return logits - presence_penalty[:, None] * (output_counts > 0)


class _LogWeights(NamedTuple):
    """Maps logits to log sampling weights: temperature applied, shifted so the row's best is 0,
    -inf below the row's cut-off (min_p, then top_k/top_p). Recomputed inside fused passes on the common path
    rather than stored as an [S, V] array."""

    peak: jax.Array  # f32[S] the row's max logit
    inv_temperature: jax.Array  # f32[S]
    floor: jax.Array  # f32[S] lowest kept log-weight

    def __call__(self, logits: jax.Array) -> jax.Array:
        log_weights = (logits - self.peak[:, None]) * self.inv_temperature[:, None]
        return jnp.where(log_weights >= self.floor[:, None], log_weights, -jnp.inf)


def _candidate_threshold(
    logits: jax.Array,
    cut: _LogWeights,
    mass: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    num_candidates: int,
) -> tuple[jax.Array, jax.Array]:
    """Lowest kept log-weight under top_k then top_p, from the `num_candidates` best logits of each row.

    `mass` is each row's total weight after min_p. Returns the threshold [S] and whether the candidates decided
    it [S]: top_k within the candidates, or top_p alone reaching p inside them.
    """
    vocab_size = logits.shape[-1]
    values = cut(jax.lax.top_k(logits, num_candidates)[0])
    probs = jnp.exp(values) / mass[:, None]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab_size), vocab_size)
    k_known = k <= num_candidates
    in_top_k = jnp.arange(num_candidates)[None, :] < k[:, None]
    # top_p is relative to the mass left by top_k (vLLM renormalises after top_k).
    kept_mass = jnp.where(k_known, jnp.sum(jnp.where(in_top_k, probs, 0.0), axis=-1), 1.0)
    mass_ahead = jnp.cumsum(probs, axis=-1) - probs
    in_top_p = (mass_ahead < (top_p * kept_mass)[:, None]) | (top_p[:, None] >= 1.0)
    num_in_top_p = jnp.sum(in_top_p, axis=-1)  # >= 1: nothing is ahead of the best token
    num_kept = jnp.minimum(jnp.minimum(k, num_in_top_p), num_candidates)
    threshold = jnp.take_along_axis(values, num_kept[:, None] - 1, axis=-1)[:, 0]
    untruncated = (top_k <= 0) & (top_p >= 1.0)
    decided = untruncated | k_known | ((top_k <= 0) & (num_in_top_p < num_candidates))
    return jnp.where(untruncated, -jnp.inf, threshold), decided


def _bisected_threshold(logits: jax.Array, cut: _LogWeights, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Exact top_k/top_p threshold for any row, by bisection on the float bits of the threshold.

    Each criterion takes 32 masked passes over [S, V]: several times cheaper than XLA's sort on CPU.
    """
    log_weights = cut(logits)
    weights = jnp.exp(log_weights)

    def highest_threshold(score, target: jax.Array) -> jax.Array:
        """Largest t (a log-weight present in the row) with score(log_weights >= t) >= target.

        Searches u = bits(-t): for t <= 0 the bits grow as t falls, and score never falls as t falls.
        """

        def halve(_, bounds):
            low, high = bounds  # score holds at high
            mid = low + (high - low) // 2
            holds = score(log_weights >= -_as_float(mid)[:, None]) >= target
            return jnp.where(holds, low, mid + 1), jnp.where(holds, mid, high)

        start = (jnp.zeros_like(target, jnp.int32), jnp.full(target.shape, _NEG_INF_BITS, jnp.int32))
        return -_as_float(jax.lax.fori_loop(0, 32, halve, start)[1])

    def count(kept: jax.Array) -> jax.Array:
        return jnp.sum(kept, axis=-1, dtype=jnp.int32)

    def mass(kept: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(kept, weights, 0.0), axis=-1)

    def where_active(active: jax.Array, threshold) -> jax.Array:
        """threshold() for active rows, -inf for the others; skipped when no row is active."""
        off = jnp.full(active.shape, -jnp.inf, jnp.float32)
        return jax.lax.cond(jnp.any(active), lambda: jnp.where(active, threshold(), off), lambda: off)

    k_threshold = where_active(top_k > 0, lambda: highest_threshold(count, top_k))
    kept_mass = mass(log_weights >= k_threshold[:, None])  # top_p is relative to what top_k keeps
    p_threshold = where_active(top_p < 1.0, lambda: highest_threshold(mass, top_p * kept_mass))
    return jnp.maximum(k_threshold, p_threshold)


def _as_float(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _top_k_top_p_threshold(
    logits: jax.Array, cut: _LogWeights, top_k: jax.Array, top_p: jax.Array, *, branch_free: bool = False
) -> jax.Array:
    """Exact truncation threshold, cheap when a small candidate set decides every row.

    Skips all work when no row truncates (batches may carry top_k/top_p just to share a compilation), then
    tries TRUNCATION_CANDIDATES in turn and finally bisection; lax.cond runs a costlier stage only when needed.
    Branch-free, every row's whole vocabulary is the candidate set: one sort, and always decided.
    """
    vocab_size = logits.shape[-1]
    if branch_free:
        mass = jnp.sum(jnp.exp(cut(logits)), axis=-1)
        return _candidate_threshold(logits, cut, mass, top_k, top_p, vocab_size)[0]
    tiers = [c for c in TRUNCATION_CANDIDATES if c < vocab_size]

    def solve(tier: int, mass: jax.Array) -> jax.Array:
        if tier == len(tiers):
            return _bisected_threshold(logits, cut, top_k, top_p)
        threshold, decided = _candidate_threshold(logits, cut, mass, top_k, top_p, tiers[tier])
        return jax.lax.cond(jnp.all(decided), lambda: threshold, lambda: solve(tier + 1, mass))

    truncates = jnp.any((top_k > 0) | (top_p < 1.0))
    untruncated = jnp.full(logits.shape[:1], -jnp.inf, logits.dtype)
    return jax.lax.cond(
        truncates, lambda: solve(0, jnp.sum(jnp.exp(cut(logits)), axis=-1)), lambda: untruncated
    )


def _first_above(weights: jax.Array, uniform: jax.Array) -> jax.Array:
    """Index where the cdf of `weights` first exceeds uniform * total; never a zero-weight entry."""
    cdf = jnp.cumsum(weights, axis=-1)
    index = jnp.sum(cdf <= (uniform * cdf[:, -1])[:, None], axis=-1)
    last_positive = jnp.max(jnp.where(weights > 0, jnp.arange(weights.shape[-1])[None, :], 0), axis=-1)
    return jnp.where(index < weights.shape[-1], index, last_positive)  # rounding at the very top


def _inverse_cdf(logits: jax.Array, cut: _LogWeights, uniforms: jax.Array) -> jax.Array:
    """Draw index ~ exp(cut(logits)) with two uniforms per row: a block of the vocabulary, then a token in it.

    Two levels keep cumulative sums short (XLA's cumsum over a whole [S, V] row is slow on CPU), and only the
    block sums read all of V, fused with the exp.
    """
    blocks = _vocab_blocks(logits)
    block = blocks.shape[-1]
    block_mass = jnp.sum(jnp.exp(cut(logits)).reshape(blocks.shape), axis=-1)
    chosen_block = _first_above(block_mass, uniforms[:, 0])
    in_block = jnp.take_along_axis(blocks, chosen_block[:, None, None], axis=1)[:, 0]
    return (chosen_block * block + _first_above(jnp.exp(cut(in_block)), uniforms[:, 1])).astype(jnp.int32)


def _uniforms(keys: jax.Array, steps: jax.Array) -> jax.Array:
    """f32[S, 2] from fold_in(key(seed), step): a row's draw never depends on its row or the batch."""
    row_keys = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(keys, impl="threefry2x32"), steps)
    return jax.vmap(lambda key: jax.random.uniform(key, (2,), jnp.float32))(row_keys)


def _random_tokens(
    logits: jax.Array, peak: jax.Array, t: SamplingTensors, *, branch_free: bool = False
) -> jax.Array:
    """temperature -> min_p -> top_k -> top_p -> draw, as vLLM v1 orders them."""
    inv_temperature = 1.0 / jnp.where(t.temperature < SAMPLING_EPS, 1.0, t.temperature)
    cut = _LogWeights(peak, inv_temperature, jnp.log(t.min_p))  # min_p: p >= min_p * p_max
    if t.top_k is not None:
        threshold = _top_k_top_p_threshold(logits, cut, t.top_k, t.top_p, branch_free=branch_free)
        cut = cut._replace(floor=jnp.maximum(cut.floor, threshold))
    return _inverse_cdf(logits, cut, _uniforms(t.keys, t.steps))


def _when(needed: jax.Array, stage, x: jax.Array, *, branch_free: bool) -> jax.Array:
    """stage(x) where some row needs it, else x; branch-free, stage(x) always (its inputs are neutral where
    unused)."""
    if branch_free:
        return stage(x)
    return jax.lax.cond(needed, stage, lambda x: x, x)


def allowed_tokens(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """bool[S, V] from the int32 words [S, W]: bit j of word i is token 32 i + j."""
    bits = jnp.right_shift(bitmask[:, :, None], jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(jnp.bool_)


def _stages(vocab_size: int, t: SamplingTensors) -> list[tuple[jax.Array, Callable[[jax.Array], jax.Array]]]:
    """(whether some row needs it, the stage) for the token bitmask, then logit_bias, then penalties."""

    def restrict(logits):
        return jnp.where(allowed_tokens(t.token_bitmask, vocab_size), logits, -jnp.inf)

    def bias(logits):
        return logits + _scatter_rows(t.bias_ids, t.bias_values, vocab_size, jnp.float32, "add")

    def penalise(logits):
        return apply_penalties(
            logits, t.history, t.prompt_lens, t.presence_penalty, t.frequency_penalty, t.repetition_penalty
        )

    penalised = (t.presence_penalty != 0) | (t.frequency_penalty != 0) | (t.repetition_penalty != 1.0)
    return [
        (jnp.any(t.token_bitmask != -1), restrict),
        (jnp.any(t.bias_ids < vocab_size), bias),
        (jnp.any(penalised), penalise),
    ]


def _processed_logits(raw: jax.Array, stages: list, *, branch_free: bool) -> jax.Array:
    """The raw logits through `_stages`' stages, each skipped where no row needs it."""
    logits = raw
    for needed, stage in stages:
        logits = _when(needed, stage, logits, branch_free=branch_free)
    return logits


def gather_logprobs(
    logits: jax.Array, token_ids: jax.Array, num_logprobs: int, ranked: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Logprobs of raw logits [N, V]: [N, 1 + K] values and ids (the given token, then the top K), and rank.
    The top K are those of `ranked` (default: the logits), normalised as the logits are.

    Also serves prompt logprobs: pass the prompt positions' logits and the next prompt tokens. Never
    materialises log_softmax over V: ranks and top-K are read off the logits, then shifted by logsumexp.
    """
    peak = jnp.max(logits, axis=-1)[:, None]
    log_normaliser = peak + jnp.log(jnp.sum(jnp.exp(logits - peak), axis=-1, keepdims=True))
    chosen = jnp.take_along_axis(logits, token_ids[:, None], axis=-1)
    rank = jnp.sum(logits >= chosen, axis=-1).astype(jnp.int32)  # vLLM counts ties as ahead
    top_values, top_ids = jax.lax.top_k(logits if ranked is None else ranked, num_logprobs)
    values = jnp.concatenate([chosen, top_values], axis=-1) - log_normaliser
    ids = jnp.concatenate([token_ids[:, None], top_ids.astype(jnp.int32)], axis=-1)
    return values, ids, rank


def sample(logits: jax.Array, t: SamplingTensors, *, branch_free: bool = False) -> SamplerOutput:
    """Device side: pick one token per row from logits [S, V], with the top MAX_LOGPROBS logprobs when some row
    asks (zeros otherwise); `branch_free` is static (see the module doc)."""
    raw = logits.astype(jnp.float32)
    stages = _stages(raw.shape[-1], t)
    if branch_free:
        return _sample_processed(raw, _processed_logits(raw, stages, branch_free=True), t, branch_free=True)
    # Where no row is restricted, biased or penalised the whole sampling runs on the raw logits: one cond around
    # all of it rather than a stage's cond handing them back, which copies [S, V] floats (a program's parameter
    # cannot be its conditional's result).
    processing = functools.reduce(jnp.logical_or, [needed for needed, _ in stages])
    return jax.lax.cond(
        processing,
        lambda: _sample_processed(
            raw, _processed_logits(raw, stages, branch_free=False), t, branch_free=False
        ),
        lambda: _sample_processed(raw, raw, t, branch_free=False),
    )


def _sample_processed(raw: jax.Array, processed: jax.Array, t: SamplingTensors, *, branch_free: bool):
    """`sample` from the raw logits and the processed ones (the bitmask, bias and penalties applied)."""
    greedy_ids = argmax_rows(processed)
    peak = jnp.take_along_axis(processed, greedy_ids[:, None], axis=-1)[:, 0]
    greedy = t.temperature < SAMPLING_EPS
    draw = lambda: _random_tokens(processed, peak, t, branch_free=branch_free)  # noqa: E731
    if branch_free:
        token_ids = jnp.where(greedy, greedy_ids, draw())
    else:  # skipped at run time when every row is greedy, so one program serves both
        token_ids = jax.lax.cond(
            jnp.all(greedy), lambda: greedy_ids, lambda: jnp.where(greedy, greedy_ids, draw())
        )

    def logprobs():
        # Beam rows rank their proposals after the bitmask, as transformers' constrained beam search does
        # (log-softmax of the raw logits, disallowed tokens at -inf); they have no bias or penalties.
        ranked = jnp.where(t.masked_top_logprobs[:, None], processed, raw)
        return gather_logprobs(raw, token_ids, MAX_LOGPROBS, ranked)

    if branch_free:
        return SamplerOutput(token_ids, *logprobs())
    num_rows = raw.shape[0]
    none = (
        jnp.zeros((num_rows, 1 + MAX_LOGPROBS), jnp.float32),
        jnp.zeros((num_rows, 1 + MAX_LOGPROBS), jnp.int32),
        jnp.zeros(num_rows, jnp.int32),
    )
    return SamplerOutput(token_ids, *jax.lax.cond(jnp.any(t.wants_logprobs), logprobs, lambda: none))
