"""The model as it was before the Flax NNX port (commit f470552): one pure function over a flat params dict, XLA's
dots only. Frozen here as the reference the NNX modules must reproduce (tests/test_models.py)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jpaged.models.batch import KVCache, StepBatch
from jpaged.models.config import ModelConfig
from jpaged.models.rope import rope_inv_freq


def flat_params(params: dict) -> dict:
    """A CausalLM state dict in the old tree: embed, final_norm, lm_head, layers/{attn_norm, w_qkv, ...}."""
    layers, attn, mlp = params["layers"], params["layers"]["attn"], params["layers"]["mlp"]
    old = {
        "attn_norm": layers["attn_norm"]["weight"],
        "mlp_norm": layers["mlp_norm"]["weight"],
        "w_qkv": attn["qkv"],
        "wo": attn["o"],
        "w_gate_up": mlp["gate_up"],
        "w_down": mlp["down"],
    }
    if "qkv_bias" in attn:
        old["b_qkv"] = attn["qkv_bias"]
    if "q_norm" in attn:
        old["q_norm"], old["k_norm"] = attn["q_norm"]["weight"], attn["k_norm"]["weight"]
    flat = {"embed": params["embed"]["weight"], "final_norm": params["final_norm"]["weight"], "layers": old}
    if "lm_head" in params:
        flat["lm_head"] = params["lm_head"]
    return flat


def _rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(x.dtype)


def forward(
    params: dict, kv_cache: KVCache, batch: StepBatch, *, config: ModelConfig, attention: Callable
) -> tuple[jax.Array, KVCache]:
    c = config
    dtype = params["final_norm"].dtype
    num_tokens = batch.token_ids.shape[0]
    block_size = kv_cache.k.shape[2]
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    angles = batch.positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(c))[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]
    cos, sin = jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)
    write_block, write_offset = batch.slot_mapping // block_size, batch.slot_mapping % block_size

    def layer(carry, xs):
        x, k_cache, v_cache = carry
        lp, index = xs
        h = _rms_norm(x, lp["attn_norm"], c.rms_norm_eps)
        qkv = h @ lp["w_qkv"]
        if c.attention_bias:
            qkv = qkv + lp["b_qkv"]
        q = qkv[:, :q_size].reshape(num_tokens, c.num_heads, c.head_dim)
        k = qkv[:, q_size : q_size + kv_size].reshape(num_tokens, c.num_kv_heads, c.head_dim)
        v = qkv[:, q_size + kv_size :].reshape(num_tokens, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = _rms_norm(q, lp["q_norm"], c.rms_norm_eps)
            k = _rms_norm(k, lp["k_norm"], c.rms_norm_eps)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k_cache = k_cache.at[index, write_block, write_offset].set(k.astype(k_cache.dtype))
        v_cache = v_cache.at[index, write_block, write_offset].set(v.astype(v_cache.dtype))
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
        x = x + attn.reshape(num_tokens, q_size).astype(dtype) @ lp["wo"]
        h = _rms_norm(x, lp["mlp_norm"], c.rms_norm_eps)
        gate, up = jnp.split(h @ lp["w_gate_up"], 2, axis=-1)
        x = x + (jax.nn.silu(gate) * up) @ lp["w_down"]
        return (x, k_cache, v_cache), None

    x = params["embed"][batch.token_ids]
    layer_ids = jnp.arange(c.num_layers, dtype=jnp.int32)
    (x, k_cache, v_cache), _ = jax.lax.scan(layer, (x, kv_cache.k, kv_cache.v), (params["layers"], layer_ids))
    h = _rms_norm(x[batch.logits_indices], params["final_norm"], c.rms_norm_eps)
    lm_head = params["lm_head"] if "lm_head" in params else params["embed"].T
    return jnp.dot(h, lm_head, preferred_element_type=jnp.float32), KVCache(k_cache, v_cache)
