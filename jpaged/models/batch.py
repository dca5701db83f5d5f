"""What the model takes and updates each step, as the runner builds it: the padded batch and the paged KV cache.
Plain NamedTuples, no JAX import, so host code that builds batches (runner/step_batch.py) runs without JAX."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import jax


class StepBatch(NamedTuple):
    """The padded batch the model runner builds from a schedule (all int32)."""

    token_ids: jax.Array  # [T]
    positions: jax.Array  # [T]
    slot_mapping: jax.Array  # [T]  block * B + offset; padding writes to the null block 0
    block_tables: jax.Array  # [S, P]
    query_start: jax.Array  # [S + 1] cumulative query offsets
    kv_lens: jax.Array  # [S] context length including this step's tokens
    num_seqs: jax.Array  # [1] live sequences
    logits_indices: jax.Array  # [R] token rows whose logits are returned
    num_logits: jax.Array  # [1] rows of logits_indices in use (the rest is padding: its logits may be zero)
    # [T] each token's max(its sequence's prompt length, position + 1): what LongRoPE and dynamic NTK scale by
    # (rope.py); None reads as position + 1.
    rope_lengths: jax.Array | None = None
    # [T] each token's LoRA slot (0: the base model; models/lora.py); None where the engine serves no adapters.
    lora_slots: jax.Array | None = None


class KVCache(NamedTuple):
    """The paged pool, in the model's dtype (or float8 e4m3, `--kv-cache-dtype fp8`), or for the C++ attention on
    CPU as raw words: a bfloat16 pool as uint16 (XLA CPU widens every write into a bfloat16 pool to a float32 copy
    of the whole pool and back, scripts/KERNELS.md), an e4m3 one as uint8 (XLA CPU copies a whole float8 array on
    every in-place write: 1.1 s a GiB)."""

    k: jax.Array  # [L, N, B, Hk, Dh]
    v: jax.Array
