"""Token ids as arrays in and out, for JAX research code (RL rollouts): prompts from a `[B, T]` array with
per-row lengths, outputs packed into padded device arrays that a loss can take without a host loop per row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from jpaged.outputs import RequestOutput


@dataclass(frozen=True)
class GeneratedArrays:
    """Row i holds prompt i's output: `tokens[i, :lengths[i]]`, padded past it."""

    tokens: jax.Array  # int32 [B, N], N = the params' max_tokens
    lengths: jax.Array  # int32 [B]
    logprobs: jax.Array | None = None  # float32 [B, N]: each sampled token's logprob (0 past the length)


def is_array(x) -> bool:
    return isinstance(x, (np.ndarray, jax.Array))


def prompt_rows(token_ids, lengths=None) -> list[list[int]]:
    """Prompts from a `[B, T]` array (row i is `token_ids[i, :lengths[i]]`, all of T by default), or from a list
    of 1-D arrays."""
    if not is_array(token_ids):
        if lengths is not None:
            raise ValueError("lengths goes with a [B, T] token_ids array, not with a list of prompts")
        return [[int(t) for t in np.asarray(row).reshape(-1)] for row in token_ids]
    ids = np.asarray(token_ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token_ids must be an integer array [B, T], got {ids.dtype}{list(ids.shape)}")
    counts = np.full(len(ids), ids.shape[1]) if lengths is None else np.asarray(lengths)
    if counts.shape != (len(ids),) or not np.issubdtype(counts.dtype, np.integer):
        raise ValueError(
            f"lengths must be integers [{len(ids)}], one per row, got {counts.dtype}{list(counts.shape)}"
        )
    if counts.size and (counts.min() < 1 or counts.max() > ids.shape[1]):
        raise ValueError(f"lengths must be in [1, {ids.shape[1]}] (the rows' width), got {counts.tolist()}")
    return [row[:count].tolist() for row, count in zip(ids, counts, strict=True)]


def pack_outputs(
    outputs: Sequence[RequestOutput], width: int, pad_token_id: int, with_logprobs: bool
) -> GeneratedArrays:
    """One row per request (its first sample), padded to `width` tokens, on the default device."""
    tokens = np.full((len(outputs), width), pad_token_id, np.int32)
    lengths = np.zeros(len(outputs), np.int32)
    logprobs = np.zeros((len(outputs), width), np.float32) if with_logprobs else None
    for row, output in enumerate(outputs):
        completion = output.outputs[0]
        count = len(completion.token_ids)
        tokens[row, :count], lengths[row] = completion.token_ids, count
        if logprobs is not None:
            sampled = zip(completion.token_ids, completion.logprobs, strict=True)
            logprobs[row, :count] = [entries[token].logprob for token, entries in sampled]
    put = jax.device_put
    return GeneratedArrays(put(tokens), put(lengths), None if logprobs is None else put(logprobs))
