"""Rotary position embeddings as transformers computes them: the inverse frequencies (with linear or llama3
scaling), each token's cos/sin, and the rotate-half rotation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.models.config import ModelConfig


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


def cos_sin(positions: jax.Array, config: ModelConfig, dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, 1, Dh] of the tokens at `positions` [T], angles in float32, rounded to `dtype`."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(config))[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """transformers' rotate-half RoPE on [T, H, Dh] with cos/sin [T, 1, Dh]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(x.dtype)
