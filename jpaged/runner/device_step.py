"""The device step as one pure function of (params, KV cache, last tokens, packed inputs, wide sampling inputs): the
model (its NNX graph merged with the params, the state dict), then sampling. The runner jits it once per shape
bucket with the cache and the last tokens donated; prompt logprobs are a second program over the step's hidden
states, one per token bucket.

`last_tokens` [R] holds the tokens the previous step sampled, row by row: a step scheduled before the previous
one's tokens reached the host (async scheduling) names such an input token -(row + 1), and takes it from there."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jpaged.models.llama import KVCache, MatrixProducts
from jpaged.runner.packed_inputs import unpack
from jpaged.runner.sampler import gather_logprobs, sample
from jpaged.sampling_params import MAX_LOGPROBS


def device_step(
    params,
    kv_cache,
    last_tokens,
    packed,
    wide,
    *,
    layout,
    graphdef,
    attention,
    products,
    branch_free,
):
    """`packed` holds the step's batch and sampling tensors but their wide fields (packed_inputs.py), `wide` the
    wide fields (sampling_inputs.WIDE_FIELDS). Also returns every token's hidden states [T, D], which
    `prompt_logprobs` reads when a request asks for them (kept on the device otherwise)."""
    batch, sampling = unpack(packed, layout)
    sampling = sampling._replace(**wide)
    batch = batch._replace(token_ids=with_last_tokens(batch.token_ids, last_tokens))
    model = nnx.merge(graphdef, params)
    hidden, kv_cache = model.hidden_states(kv_cache, batch, attention=attention, products=products)
    logits = model.logits(hidden[batch.logits_indices], batch.num_logits[0], products)
    sampled = sample(logits, sampling, branch_free=branch_free)
    last_tokens = last_tokens.at[: logits.shape[0]].set(sampled.token_ids)
    return kv_cache, last_tokens, sampled, hidden


def prompt_logprobs(params, hidden, targets, num_tokens, *, graphdef, products):
    """The top MAX_LOGPROBS logprobs at every token of a step, and those of each token's target (its next prompt
    token): values and ids [T, 1 + K], ranks [T]; `num_tokens` [1] of the T are real (the rest is padding)."""
    model = nnx.merge(graphdef, params)
    return gather_logprobs(model.logits(hidden, num_tokens[0], products), targets, MAX_LOGPROBS)


def with_last_tokens(token_ids: jax.Array, last_tokens: jax.Array) -> jax.Array:
    """Input tokens with each -(row + 1) replaced by the token the previous step sampled in that row."""
    return jnp.where(token_ids < 0, jnp.take(last_tokens, jnp.maximum(-1 - token_ids, 0)), token_ids)


def bind_step(
    graphdef: nnx.GraphDef, attention: Callable, products: MatrixProducts, *, branch_free: bool
) -> Callable:
    """`device_step` for one model (the static half of its `nnx.split`), attention implementation, weight
    layout and sampler form (all static; branch-free on accelerators, see sampler.py)."""
    return functools.partial(
        device_step, graphdef=graphdef, attention=attention, products=products, branch_free=branch_free
    )


def bind_prompt_logprobs(graphdef: nnx.GraphDef, products: MatrixProducts) -> Callable:
    return functools.partial(prompt_logprobs, graphdef=graphdef, products=products)


def copy_blocks(kv_cache: KVCache, copies: jax.Array) -> KVCache:
    """Copy block src to block dst, all layers, for each (src, dst) row of `copies` [R, 2]; padding rows are
    (0, 0), the null block onto itself. One gather and one scatter of fixed shape (no loop whose trip count the
    device decides), run by the runner before a step that has copies: no dst is also a src (dst blocks are
    fresh)."""
    src, dst = copies[:, 0], copies[:, 1]
    return KVCache(*(pages.at[:, dst].set(pages[:, src]) for pages in kv_cache))


def scatter_blocks(kv_cache: KVCache, ids: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
    """Blocks `ids` of every layer set to k, v [L, len(ids), B, Hk, D] (swap-in, and copies outside a step)."""
    return KVCache(kv_cache.k.at[:, ids].set(k), kv_cache.v.at[:, ids].set(v))
