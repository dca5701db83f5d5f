"""The Llama family as one pure function: Llama 2/3/3.1, SmolLM2, Mistral, Qwen2/2.5, Qwen3.

Shapes: T tokens in the step, S sequences (rows whose logits are wanted), D hidden size, F MLP size, V vocabulary,
L layers, Hq/Hk query/KV heads, Dh head dim, N blocks, B block size.

Params pytree (weights stored [in, out]; per-layer leaves stacked on a leading L axis so `lax.scan` compiles one
layer, not thirty; q/k/v and gate/up fused so each is one matmul):
  embed [V, D], final_norm [D], lm_head [D, V] (absent when tied to embed),
  layers: attn_norm [L, D], w_qkv [L, D, (Hq + 2 Hk) Dh], b_qkv [L, (Hq + 2 Hk) Dh] (Qwen2),
          q_norm / k_norm [L, Dh] (Qwen3), wo [L, Hq Dh, D], mlp_norm [L, D], w_gate_up [L, D, 2F], w_down [L, F, D]
KV cache: (k, v), each [L, N, B, Hk, Dh]; the step writes its new K/V through `slot_mapping` and attends through
`block_tables`. Both are donated by the caller, so the scatter updates them in place.

Attention and the matrix products are injected: `forward` knows no kernel and no weight layout. The runner passes
the attention callable for its backend and a `MatrixProducts` for the layout it keeps the weights in (the stacks
above, `StackedProducts`, unless it chose another, e.g. the CPU kernel's panels).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.models.batch import KVCache, StepBatch
from jpaged.models.config import ModelConfig


class MatrixProducts(Protocol):
    """How the model multiplies by its weights, for one layout of the params. `rows` is how many leading rows of
    x are live (the rest is padding, which a layout may skip and leave zero)."""

    def layout(self, params: dict) -> dict:
        """The loaders' params rearranged as these products read them (done once, before the steps)."""
        ...

    def embed(self, params: dict, token_ids: jax.Array) -> jax.Array: ...

    def layer(
        self, params: dict, layer_params: dict, name: str, layer: jax.Array, x: jax.Array, rows: jax.Array
    ) -> jax.Array:
        """x @ layer `layer`'s matrix `name` (w_qkv, wo, w_gate_up, w_down); `layer_params` is that layer's
        slice of params["layers"]."""
        ...

    def lm_head(self, params: dict, h: jax.Array, rows: jax.Array) -> jax.Array:
        """float32 logits [R, V] of the final hidden states h [R, D]."""
        ...


class StackedProducts:
    """XLA's dots on the params as the loaders build them (layer matrices stacked, sliced per layer by the scan)."""

    def layout(self, params: dict) -> dict:
        return params

    def embed(self, params: dict, token_ids: jax.Array) -> jax.Array:
        return params["embed"][token_ids]

    def layer(self, params, layer_params, name, layer, x, rows) -> jax.Array:
        return x @ layer_params[name]

    def lm_head(self, params: dict, h: jax.Array, rows: jax.Array) -> jax.Array:
        lm_head = params["lm_head"] if "lm_head" in params else params["embed"].T
        return jnp.dot(h, lm_head, preferred_element_type=jnp.float32)


STACKED = StackedProducts()


def _as_stored(x: jax.Array, dtype) -> jax.Array:
    """x as the pool stores it: its dtype, or its raw words where the pool keeps a 16-bit float as uint16 (see
    KVCache)."""
    if jnp.dtype(dtype) == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(dtype)


def init_kv_cache(
    config: ModelConfig, num_blocks: int, block_size: int, dtype, allocate: Callable = jnp.zeros
) -> KVCache:
    """The pool, zero-filled unless `allocate` says otherwise (attention that reads whole pages needs finite
    values in the slots it masks)."""
    shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return KVCache(allocate(shape, dtype), allocate(shape, dtype))


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Rotary inverse frequencies [Dh / 2], with linear or llama3 (Llama 3.1) scaling as in transformers."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling_dict
    if not scaling:
        return inv_freq.astype(np.float32)
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return (inv_freq / factor).astype(np.float32)
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """transformers' rotate-half RoPE on [T, H, Dh] with cos/sin [T, 1, Dh]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(x.dtype)


def forward(
    params: dict,
    kv_cache: KVCache,
    batch: StepBatch,
    *,
    config: ModelConfig,
    attention: Callable,
    products: MatrixProducts = STACKED,
) -> tuple[jax.Array, KVCache]:
    """Run the step's tokens through the model; returns (float32 logits [R, V], updated cache)."""
    c = config
    dtype = params["final_norm"].dtype
    num_tokens = batch.token_ids.shape[0]
    block_size = kv_cache.k.shape[2]
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    angles = batch.positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(c))[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]
    cos, sin = jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)
    write_block, write_offset = batch.slot_mapping // block_size, batch.slot_mapping % block_size

    live_tokens = batch.query_start[batch.num_seqs[0]]

    def matmul(name: str, lp: dict, index: jax.Array, x: jax.Array) -> jax.Array:
        return products.layer(params, lp, name, index, x, live_tokens)

    def layer(carry, xs):
        x, k_cache, v_cache = carry
        lp, index = xs
        h = _rms_norm(x, lp["attn_norm"], c.rms_norm_eps)
        qkv = matmul("w_qkv", lp, index, h)
        if c.attention_bias:
            qkv = qkv + lp["b_qkv"]
        q = qkv[:, :q_size].reshape(num_tokens, c.num_heads, c.head_dim)
        k = qkv[:, q_size : q_size + kv_size].reshape(num_tokens, c.num_kv_heads, c.head_dim)
        v = qkv[:, q_size + kv_size :].reshape(num_tokens, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = _rms_norm(q, lp["q_norm"], c.rms_norm_eps)
            k = _rms_norm(k, lp["k_norm"], c.rms_norm_eps)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k_cache = k_cache.at[index, write_block, write_offset].set(_as_stored(k, k_cache.dtype))
        v_cache = v_cache.at[index, write_block, write_offset].set(_as_stored(v, v_cache.dtype))
        attn = attention(
            q,
            k_cache,
            v_cache,
            index,
            batch.kv_lens,
            batch.block_tables,
            batch.query_start,
            batch.num_seqs,
            sm_scale=c.head_dim**-0.5,
            sliding_window=c.sliding_window,
        )
        x = x + matmul("wo", lp, index, attn.reshape(num_tokens, q_size).astype(dtype))
        h = _rms_norm(x, lp["mlp_norm"], c.rms_norm_eps)
        gate, up = jnp.split(matmul("w_gate_up", lp, index, h), 2, axis=-1)
        x = x + matmul("w_down", lp, index, jax.nn.silu(gate) * up)
        return (x, k_cache, v_cache), None

    x = products.embed(params, batch.token_ids)
    layer_ids = jnp.arange(c.num_layers, dtype=jnp.int32)
    (x, k_cache, v_cache), _ = jax.lax.scan(layer, (x, kv_cache.k, kv_cache.v), (params["layers"], layer_ids))
    h = _rms_norm(x[batch.logits_indices], params["final_norm"], c.rms_norm_eps)
    logits = products.lm_head(params, h, batch.num_logits[0])
    return logits, KVCache(k_cache, v_cache)
