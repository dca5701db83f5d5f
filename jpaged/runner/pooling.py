"""The device side of pooling (embeddings): a forward that returns, instead of logits, one float32 vector [D] per
scheduled sequence, pooled over the tokens it computed this step (its chunk), after the final norm:

  last   the chunk's last token (the prompt's last token once the chunk ends the prompt);
  cls    the chunk's first token (the prompt's first token in its first chunk);
  mean   the sum over the chunk's tokens (the host adds the chunks' sums up and divides: see core/pooling.py).

A pure function of (params, KV cache, batch) like the generation forward, jitted per shape bucket with the cache
donated; padding rows pool garbage nobody reads."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jpaged.models.batch import StepBatch
from jpaged.runner.packed_inputs import unpack

Norm = Callable[[jax.Array], jax.Array]


def pool_last(hidden: jax.Array, batch: StepBatch, norm: Norm) -> jax.Array:
    """[S, D]: each sequence's last token this step."""
    return norm(hidden[jnp.maximum(batch.query_start[1:] - 1, 0)]).astype(jnp.float32)


def pool_first(hidden: jax.Array, batch: StepBatch, norm: Norm) -> jax.Array:
    """[S, D]: each sequence's first token this step."""
    last = hidden.shape[0] - 1
    return norm(hidden[jnp.minimum(batch.query_start[:-1], last)]).astype(jnp.float32)


def pool_sum(hidden: jax.Array, batch: StepBatch, norm: Norm) -> jax.Array:
    """[S, D]: the sum of each sequence's tokens this step (padding tokens fall in a segment past the last)."""
    num_seqs = batch.query_start.shape[0] - 1
    tokens = jnp.arange(hidden.shape[0], dtype=jnp.int32)
    segment = jnp.searchsorted(batch.query_start[1:], tokens, side="right")  # S for padding tokens
    normed = norm(hidden).astype(jnp.float32)
    return jax.ops.segment_sum(normed, segment, num_segments=num_seqs + 1)[:num_seqs]


POOLINGS = {"last": pool_last, "cls": pool_first, "mean": pool_sum}


def pooling_forward(
    params, kv_cache, last_tokens, packed, *, layout, graphdef, attention, products, pooling: str
):
    """`packed` holds the step's batch (packed_inputs.py); `last_tokens` is unused (nothing is sampled) but kept,
    so the step programs lower it as they lower the generation forward. Returns (KV cache, pooled [S, D])."""
    del last_tokens
    batch = unpack(packed, layout)
    model = nnx.merge(graphdef, params)
    hidden, kv_cache, _ = model.hidden_states(kv_cache, batch, attention=attention, products=products)
    return kv_cache, POOLINGS[pooling](hidden, batch, model.final_norm)


def bind_pooling_forward(graphdef: nnx.GraphDef, attention: Callable, products, pooling: str) -> Callable:
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {sorted(POOLINGS)}, got {pooling!r}")
    return functools.partial(
        pooling_forward, graphdef=graphdef, attention=attention, products=products, pooling=pooling
    )
