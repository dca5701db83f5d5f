"""Split-KV (flash-decoding) for the GPU kernels: how many ways a decode bucket splits each sequence's KV range,
and the one softmax XLA makes of the parts.

A decode bucket with few sequence slots gives the GPU only Hk x S programs (3 x 1 for SmolLM2 at batch 1, on an
H200's 132 SMs), so each sequence's KV range is split `num_splits` ways, a grid axis of its own; each program keeps
its softmax's running max, sum and unnormalised output for its part. The bucket decides, from its shapes only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TARGET_PROGRAMS = 256  # about two per SM of an H200 (132 SMs): what split-KV fills a small decode step up to
MAX_SPLITS = 16
MIN_SPLIT_KEYS = 512  # keys a split must have at full context to be worth its share of the combine


def choose_num_splits(num_tokens: int, num_seq_slots: int, num_kv_heads: int, max_kv_len: int) -> int:
    """How many ways a decode bucket splits each sequence's KV range: enough programs to fill the GPU, each split
    with at least MIN_SPLIT_KEYS keys at the bucket's longest context; 1 (no split) for prefill buckets."""
    if num_tokens > 2 * num_seq_slots:
        return 1
    splits = min(MAX_SPLITS, max_kv_len // MIN_SPLIT_KEYS, TARGET_PROGRAMS // (num_kv_heads * num_seq_slots))
    return 1 << (splits.bit_length() - 1) if splits >= 2 else 1


def combine_splits(acc: jax.Array, maxima: jax.Array, sums: jax.Array) -> jax.Array:
    """One softmax from the splits' parts: acc [K, ..., D] unnormalised, maxima and sums [K, ...]."""
    peak = jnp.max(maxima, axis=0)
    weights = jnp.exp(maxima - peak)  # a split that saw no key has max NEG_INF and sum 0: weight 0 or no sum
    total = jnp.sum(sums * weights, axis=0)
    out = jnp.sum(acc * weights[..., None], axis=0)
    return out / jnp.where(total > 0, total, 1.0)[..., None]
