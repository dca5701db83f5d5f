"""The sampler's inputs as the host builds them: one `SamplingRow` per sampled row, packed into padded numpy arrays
(`SamplingTensors`), and what the step gives back (`SamplerOutput`). No JAX here: the engine's host side imports
these types; the device side is sampler.py, whose module doc says what each field switches on.

Shapes: S rows (padded batch), V vocabulary, H token-history width, B sparse logit-bias entries per row,
A allowed ids per row, K top logprobs per row (0, 5 or 20).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from jpaged.sampling_params import SamplingParams

LOGPROB_BUCKETS = (0, 5, 20)  # static top-K sizes, so the number of logprob shapes stays small
MIN_WIDTH = 16  # smallest padded width of the history / bias / allowed arrays
_UINT32 = 0xFFFFFFFF


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs about one running sequence; the engine builds one per row each step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    seed: int  # the request's seed, or one the engine drew from its own seeded RNG
    eos_token_id: int | None = None  # banned together with stop_token_ids until min_tokens are generated
    bad_words_token_ids: Sequence[Sequence[int]] = ()  # from engine.tokenizer.tokenize_bad_words
    num_pending: int = 0  # tokens it has sampled that are still on the device (async scheduling)


class SamplingTensors(NamedTuple):
    """Per-row sampling inputs, leading dim S; padded rows are greedy and unbiased. See the module doc."""

    temperature: np.ndarray  # f32[S]
    min_p: np.ndarray  # f32[S]
    keys: np.ndarray | None = None  # u32[S, 2] raw threefry key data of the row's seed
    steps: np.ndarray | None = None  # i32[S] tokens generated so far, folded into the key
    top_k: np.ndarray | None = None  # i32[S], 0 = off
    top_p: np.ndarray | None = None  # f32[S]
    history: np.ndarray | None = None  # i32[S, H] prompt then output tokens, padded with V
    prompt_lens: np.ndarray | None = None  # i32[S]
    presence_penalty: np.ndarray | None = None  # f32[S]
    frequency_penalty: np.ndarray | None = None  # f32[S]
    repetition_penalty: np.ndarray | None = None  # f32[S]
    bias_ids: np.ndarray | None = None  # i32[S, B], padded with V
    bias_values: np.ndarray | None = None  # f32[S, B], -inf bans
    allowed_ids: np.ndarray | None = None  # i32[S, A], padded with V
    vocab_restricted: np.ndarray | None = None  # bool[S], rows whose allowed_ids apply


class SamplerOutput(NamedTuple):
    token_ids: np.ndarray  # i32[S]
    logprobs: np.ndarray | None  # f32[S, 1 + K]: sampled token, then the top K; None when not asked
    logprob_token_ids: np.ndarray | None  # i32[S, 1 + K]
    sampled_rank: np.ndarray | None  # i32[S], 1-based rank of the sampled token under the raw logits


def logprobs_bucket(asked: Iterable[int | None]) -> int | None:
    """Static top-K width for a batch whose rows ask for these numbers of logprobs (None: not asked): None when
    no row asks, else the smallest bucket that covers all."""
    numbers = [n for n in asked if n is not None]
    if not numbers:
        return None
    return next(b for b in LOGPROB_BUCKETS if b >= max(numbers))


def _width(n: int) -> int:
    return max(MIN_WIDTH, 1 << (max(n, 1) - 1).bit_length())


def _padded(lists: Sequence[Sequence[float]], num_rows: int, width: int, fill: float, dtype) -> np.ndarray:
    out = np.full((num_rows, width), fill, dtype=dtype)
    for i, values in enumerate(lists):
        out[i, : len(values)] = values
    return out


def _bias_entries(row: SamplingRow) -> dict[int, float]:
    """logit_bias plus -inf bans: bad words whose prefix was just generated, stop tokens before min_tokens."""
    params, outputs = row.params, row.output_token_ids
    entries = dict(params.logit_bias or {})
    for word in row.bad_words_token_ids:
        prefix = list(word[:-1])
        if not prefix or (len(outputs) >= len(prefix) and list(outputs[-len(prefix) :]) == prefix):
            entries[word[-1]] = -np.inf
    if len(outputs) < params.min_tokens:
        stops = [*(params.stop_token_ids or []), *([] if row.eos_token_id is None else [row.eos_token_id])]
        entries.update(dict.fromkeys(stops, -np.inf))
    return entries


def build_sampling_tensors(
    rows: Sequence[SamplingRow], num_rows: int, vocab_size: int, *, history_len: int | None = None
) -> SamplingTensors:
    """Host side: pack the rows into padded numpy arrays and decide which stages this batch needs.

    `history_len` fixes H (pass max_model_len for one shape); by default H is the next power of two.
    """
    if len(rows) > num_rows:
        raise ValueError(f"num_rows ({num_rows}) is smaller than the number of rows ({len(rows)})")
    pad = num_rows - len(rows)
    params = [r.params for r in rows]

    def column(values: list, fill, dtype) -> np.ndarray:
        return np.array(values + [fill] * pad, dtype=dtype)

    fields: dict[str, np.ndarray] = {
        "temperature": column([p.temperature for p in params], 0.0, np.float32),
        "min_p": column([p.min_p for p in params], 0.0, np.float32),
    }
    if any(not p.is_greedy for p in params):
        seeds = [r.seed & 0xFFFFFFFFFFFFFFFF for r in rows]  # threefry keys hold a 64-bit seed as (hi, lo)
        fields["keys"] = _padded([[s >> 32, s & _UINT32] for s in seeds], num_rows, 2, 0, np.uint32)
        fields["steps"] = column([len(r.output_token_ids) + r.num_pending for r in rows], 0, np.int32)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        # A top_k of the vocabulary or more keeps every token: clamped, any int a client sends fits int32.
        fields["top_k"] = column([min(max(p.top_k, 0), vocab_size) for p in params], 0, np.int32)
        fields["top_p"] = column([p.top_p for p in params], 1.0, np.float32)
    if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params):
        histories = [[*r.prompt_token_ids, *r.output_token_ids] for r in rows]
        longest = max(len(h) for h in histories)
        width = _width(longest) if history_len is None else history_len
        if longest > width:
            raise ValueError(f"history_len ({width}) is shorter than a row's history ({longest})")
        fields["history"] = _padded(histories, num_rows, width, vocab_size, np.int32)
        fields["prompt_lens"] = column([len(r.prompt_token_ids) for r in rows], 0, np.int32)
        fields["presence_penalty"] = column([p.presence_penalty for p in params], 0.0, np.float32)
        fields["frequency_penalty"] = column([p.frequency_penalty for p in params], 0.0, np.float32)
        fields["repetition_penalty"] = column([p.repetition_penalty for p in params], 1.0, np.float32)
    biases = [_bias_entries(r) for r in rows]
    if any(biases):
        width = _width(max(len(b) for b in biases))
        fields["bias_ids"] = _padded([list(b) for b in biases], num_rows, width, vocab_size, np.int32)
        fields["bias_values"] = _padded([list(b.values()) for b in biases], num_rows, width, 0.0, np.float32)
    if any(p.allowed_token_ids is not None for p in params):
        allowed = [p.allowed_token_ids or [] for p in params]
        width = _width(max(len(a) for a in allowed))
        fields["allowed_ids"] = _padded(allowed, num_rows, width, vocab_size, np.int32)
        fields["vocab_restricted"] = column([p.allowed_token_ids is not None for p in params], False, bool)
    return SamplingTensors(**fields)


def step_sampling_tensors(
    rows: Sequence[SamplingRow], num_rows: int, vocab_size: int, *, branch_free: bool = False
) -> SamplingTensors:
    """Per-row sampling arrays, always with keys (an all-greedy batch skips the draw on device, or branch-free
    draws and ignores it), and with top-k/top-p unless branch-free, so greedy and sampled batches share one
    compiled program per shape (branch-free: two, with and without truncation; see sampler.py)."""
    tensors = build_sampling_tensors(rows, num_rows, vocab_size)
    if tensors.keys is None:
        tensors = tensors._replace(
            keys=np.zeros((num_rows, 2), np.uint32), steps=np.zeros(num_rows, np.int32)
        )
    return tensors if branch_free else with_truncation(tensors)


def with_truncation(tensors: SamplingTensors) -> SamplingTensors:
    """The tensors with top_k/top_p present (all off where they were absent)."""
    if tensors.top_k is not None:
        return tensors
    num_rows = tensors.temperature.shape[0]
    return tensors._replace(top_k=np.zeros(num_rows, np.int32), top_p=np.ones(num_rows, np.float32))
