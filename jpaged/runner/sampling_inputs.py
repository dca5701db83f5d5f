"""The sampler's inputs as the host builds them: one `SamplingRow` per sampled row, packed into padded numpy arrays
(`SamplingTensors`), and what the step gives back (`SamplerOutput`). No JAX here: the engine's host side imports
these types; the device side is sampler.py, whose module doc says what each field does.

Shapes: S rows (padded batch), V vocabulary, H token-history width (one of SamplingWidths.history_widths, up to
max_model_len), B logit-bias entries per row (MAX_LOGIT_BIAS_TOKENS), W = ceil(V / 32) bitmask words per row,
K = MAX_LOGPROBS top logprobs.

Every batch of S rows has the same fields and shapes, whatever its requests ask, so a shape compiles once (the
history in a few widths, each compiled at warm-up): the wide fields (WIDE_FIELDS) are None where no row needs them,
and the runner passes a copy it keeps on the device (`neutral_wide`) in their place instead of sending them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from jpaged.rounding import cdiv
from jpaged.sampling_params import MAX_LOGIT_BIAS_TOKENS, SamplingParams

WIDE_FIELDS = ("history", "bias_ids", "bias_values", "token_bitmask")
_UINT32 = 0xFFFFFFFF
# The narrowest penalty history, and the factor between one history width and the next: a long max_model_len
# costs a batch of short histories neither the transfer nor the scatter of its whole width.
MIN_HISTORY_WIDTH = 1024
HISTORY_WIDTH_GROWTH = 8


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
    grammar_bitmask: np.ndarray | None = None  # structured outputs: i32[W], the tokens its grammar allows now
    masked_top_logprobs: bool = False  # beam search: its top logprobs are its best allowed tokens


class SamplingTensors(NamedTuple):
    """Per-row sampling inputs, leading dim S; padded rows are greedy and unconstrained. See the module doc."""

    temperature: np.ndarray  # f32[S]
    min_p: np.ndarray  # f32[S]
    keys: np.ndarray  # u32[S, 2] raw threefry key data of the row's seed
    steps: np.ndarray  # i32[S] tokens generated so far, folded into the key
    prompt_lens: np.ndarray  # i32[S]
    presence_penalty: np.ndarray  # f32[S]
    frequency_penalty: np.ndarray  # f32[S]
    repetition_penalty: np.ndarray  # f32[S]
    wants_logprobs: np.ndarray  # bool[S]
    masked_top_logprobs: np.ndarray  # bool[S] the top K are ranked after the token bitmask (beam search)
    top_k: np.ndarray | None = None  # i32[S], 0 = off; None only branch-free, when no row truncates
    top_p: np.ndarray | None = None  # f32[S]
    history: np.ndarray | None = None  # i32[S, H] prompt then output tokens, padded with V
    bias_ids: np.ndarray | None = None  # i32[S, B], padded with V
    bias_values: np.ndarray | None = None  # f32[S, B]
    token_bitmask: np.ndarray | None = None  # i32[S, W], bit j of word i: token 32 i + j may be sampled


class SamplingWidths(NamedTuple):
    """The fixed widths of the wide fields, from the model and the engine's max_model_len."""

    vocab_size: int
    history_len: int
    bias_len: int = MAX_LOGIT_BIAS_TOKENS

    @property
    def bitmask_words(self) -> int:
        return cdiv(self.vocab_size, 32)

    @property
    def history_widths(self) -> tuple[int, ...]:
        """The widths a step's history may take, narrowest first, the last history_len: a batch takes the
        narrowest its longest history fits (each width's sampling compiles at warm-up)."""
        widths, width = [], min(MIN_HISTORY_WIDTH, self.history_len)
        while width < self.history_len:
            widths.append(width)
            width *= HISTORY_WIDTH_GROWTH
        return (*widths, self.history_len)


class SamplerOutput(NamedTuple):
    token_ids: np.ndarray  # i32[S]
    logprobs: np.ndarray  # f32[S, 1 + K]: sampled token, then the top K (zeros when no row asked)
    logprob_token_ids: np.ndarray  # i32[S, 1 + K]
    sampled_rank: np.ndarray  # i32[S], 1-based rank of the sampled token under the raw logits


def all_allowed_bitmask(num_rows: int, widths: SamplingWidths) -> np.ndarray:
    """Token bitmask rows with every bit set: every token allowed."""
    return np.full((num_rows, widths.bitmask_words), -1, np.int32)


def neutral_wide(num_rows: int, widths: SamplingWidths) -> dict[str, np.ndarray]:
    """The wide fields of rows that need none of them: no history (in the narrowest width), no bias, every token
    allowed."""
    vocab_size = widths.vocab_size
    return {
        "history": np.full((num_rows, widths.history_widths[0]), vocab_size, np.int32),
        "bias_ids": np.full((num_rows, widths.bias_len), vocab_size, np.int32),
        "bias_values": np.zeros((num_rows, widths.bias_len), np.float32),
        "token_bitmask": all_allowed_bitmask(num_rows, widths),
    }


def _padded(lists: Sequence[Sequence[float]], num_rows: int, width: int, fill: float, dtype) -> np.ndarray:
    out = np.full((num_rows, width), fill, dtype=dtype)
    for i, values in enumerate(lists):
        out[i, : len(values)] = values
    return out


def _bans(row: SamplingRow) -> list[int]:
    """Tokens the row may not sample now: bad words whose prefix was just generated, stop tokens before
    min_tokens."""
    params, outputs = row.params, row.output_token_ids
    banned = []
    for word in row.bad_words_token_ids:
        prefix = list(word[:-1])
        if not prefix or (len(outputs) >= len(prefix) and list(outputs[-len(prefix) :]) == prefix):
            banned.append(word[-1])
    if len(outputs) < params.min_tokens:
        banned += [*(params.stop_token_ids or []), *([] if row.eos_token_id is None else [row.eos_token_id])]
    return banned


def _bitmask(row: SamplingRow, banned: Sequence[int], widths: SamplingWidths) -> np.ndarray:
    """One row's words: its grammar's tokens and its allowed_token_ids (None: every token), less `banned`."""
    allowed = row.params.allowed_token_ids
    words = np.zeros(widths.bitmask_words, np.uint32)
    if allowed is None:
        words[:] = _UINT32
    else:
        ids = np.asarray(allowed, np.int64)
        np.bitwise_or.at(words, ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
    if banned:
        ids = np.asarray(banned, np.int64)
        np.bitwise_and.at(words, ids >> 5, ~np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
    if row.grammar_bitmask is not None:
        words &= row.grammar_bitmask.view(np.uint32)
    return words.view(np.int32)


def build_sampling_tensors(
    rows: Sequence[SamplingRow], num_rows: int, widths: SamplingWidths, *, truncation: bool = True
) -> SamplingTensors:
    """Host side: pack the rows into padded numpy arrays of the fixed shapes; the wide fields only where some
    row needs them. `truncation=False` (branch-free only) leaves top_k/top_p out when no row truncates."""
    if len(rows) > num_rows:
        raise ValueError(f"num_rows ({num_rows}) is smaller than the number of rows ({len(rows)})")
    pad = num_rows - len(rows)
    params = [r.params for r in rows]
    vocab_size = widths.vocab_size

    def column(values: list, fill, dtype) -> np.ndarray:
        return np.array(values + [fill] * pad, dtype=dtype)

    seeds = [r.seed & 0xFFFFFFFFFFFFFFFF for r in rows]  # threefry keys hold a 64-bit seed as (hi, lo)
    fields: dict[str, np.ndarray] = {
        "temperature": column([p.temperature for p in params], 0.0, np.float32),
        "min_p": column([p.min_p for p in params], 0.0, np.float32),
        "keys": _padded([[s >> 32, s & _UINT32] for s in seeds], num_rows, 2, 0, np.uint32),
        "steps": column([len(r.output_token_ids) + r.num_pending for r in rows], 0, np.int32),
        "prompt_lens": column([len(r.prompt_token_ids) for r in rows], 0, np.int32),
        "presence_penalty": column([p.presence_penalty for p in params], 0.0, np.float32),
        "frequency_penalty": column([p.frequency_penalty for p in params], 0.0, np.float32),
        "repetition_penalty": column([p.repetition_penalty for p in params], 1.0, np.float32),
        "wants_logprobs": column([p.logprobs is not None for p in params], False, bool),
        "masked_top_logprobs": column([r.masked_top_logprobs for r in rows], False, bool),
    }
    if truncation or any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        # A top_k of the vocabulary or more keeps every token: clamped, any int a client sends fits int32.
        fields["top_k"] = column([min(max(p.top_k, 0), vocab_size) for p in params], 0, np.int32)
        fields["top_p"] = column([p.top_p for p in params], 1.0, np.float32)
    penalised = [
        bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0) for p in params
    ]
    if any(penalised):
        # Only penalised rows need theirs: the others' (padding) change nothing.
        histories = [
            [*r.prompt_token_ids, *r.output_token_ids] if wanted else []
            for r, wanted in zip(rows, penalised, strict=True)
        ]
        longest = max(len(h) for h in histories)
        if longest > widths.history_len:
            raise ValueError(
                f"history_len ({widths.history_len}) is shorter than a row's history ({longest})"
            )
        width = next(width for width in widths.history_widths if width >= longest)
        fields["history"] = _padded(histories, num_rows, width, vocab_size, np.int32)
    if any(p.logit_bias for p in params):
        biases = [p.logit_bias or {} for p in params]
        longest = max(len(b) for b in biases)
        if longest > widths.bias_len:
            raise ValueError(f"a row has {longest} logit_bias entries; the sampler takes {widths.bias_len}")
        fields["bias_ids"] = _padded(
            [list(b) for b in biases], num_rows, widths.bias_len, vocab_size, np.int32
        )
        fields["bias_values"] = _padded(
            [list(b.values()) for b in biases], num_rows, widths.bias_len, 0.0, np.float32
        )
    bans = [_bans(r) for r in rows]
    restricted = any(p.allowed_token_ids is not None for p in params)
    if any(bans) or restricted or any(r.grammar_bitmask is not None for r in rows):
        masks = fields["token_bitmask"] = all_allowed_bitmask(num_rows, widths)  # padding rows stay so
        for i, (row, banned) in enumerate(zip(rows, bans, strict=True)):
            masks[i] = _bitmask(row, banned, widths)
    return SamplingTensors(**fields)


def split_wide(tensors: SamplingTensors) -> tuple[SamplingTensors, dict[str, np.ndarray | None]]:
    """The tensors without their wide fields (what the step's packed buffer carries), and the wide fields."""
    return tensors._replace(**dict.fromkeys(WIDE_FIELDS)), {f: getattr(tensors, f) for f in WIDE_FIELDS}
