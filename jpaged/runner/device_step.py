"""The device step as one pure function of (params, KV cache, batch, sampling inputs): the model (its NNX graph
merged with the params, the state dict), then sampling. The runner jits it once per shape bucket with the cache donated."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from flax import nnx

from jpaged.models.llama import KVCache, MatrixProducts
from jpaged.runner.packed_inputs import unpack
from jpaged.runner.sampler import gather_logprobs, sample


def device_step(
    params,
    kv_cache,
    packed,
    *,
    layout,
    graphdef,
    attention,
    products,
    num_logprobs,
    num_prompt_logprobs,
):
    """`packed` holds the step's batch, sampling tensors and prompt targets (packed_inputs.py). With prompt
    targets [T] (the prompt-logprobs variant), the batch asks for the logits of every token after the S sampled
    rows, and the logprobs of each token's next prompt token come back too."""
    batch, sampling, prompt_targets = unpack(packed, layout)
    model = nnx.merge(graphdef, params)
    logits, kv_cache = model(kv_cache, batch, attention=attention, products=products)
    num_rows = sampling.temperature.shape[0]
    sampled = sample(logits[:num_rows], sampling, num_logprobs=num_logprobs)
    if prompt_targets is None:
        return kv_cache, sampled, None
    return kv_cache, sampled, gather_logprobs(logits[num_rows:], prompt_targets, num_prompt_logprobs)


def bind_step(graphdef: nnx.GraphDef, attention: Callable, products: MatrixProducts) -> Callable:
    """`device_step` for one model (the static half of its `nnx.split`), attention implementation and weight
    layout (all static)."""
    return functools.partial(device_step, graphdef=graphdef, attention=attention, products=products)


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
