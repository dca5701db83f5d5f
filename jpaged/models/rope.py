"""Rotary position embeddings as transformers computes them: the inverse frequencies (with linear, llama3 or YaRN
scaling, SCALINGS), each token's cos/sin, and the rotate-half rotation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Rotary inverse frequencies [Dh / 2] under the config's scaling, as transformers computes them."""
    return rope_frequencies(config)[0]


def rope_frequencies(config: ModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies [Dh / 2] and the factor cos and sin are scaled by (YaRN's attention factor, else 1)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling_dict
    if not scaling:
        return inv_freq.astype(np.float32), 1.0
    inv_freq, attention_factor = SCALINGS[scaling["rope_type"]](inv_freq, scaling, config)
    return inv_freq.astype(np.float32), attention_factor


def _linear(inv_freq: np.ndarray, scaling: dict, config: ModelConfig) -> tuple[np.ndarray, float]:
    return inv_freq / scaling["factor"], 1.0


def _llama3(inv_freq: np.ndarray, scaling: dict, config: ModelConfig) -> tuple[np.ndarray, float]:
    """Llama 3.1: long wavelengths divided by the factor, short ones kept, a smooth blend between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled), 1.0


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(inv_freq: np.ndarray, scaling: dict, config: ModelConfig) -> tuple[np.ndarray, float]:
    """YaRN (Qwen2.5/Qwen3 past 32k): interpolate the slow dimensions by the factor, keep the fast ones, ramp
    linearly between the dimensions that turn beta_fast and beta_slow times over the original context; cos and sin
    scaled by the attention factor."""
    dim, base = config.head_dim, config.rope_theta
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / old_len
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: the dimension keeps its frequency (extrapolation), 0: divided by the factor
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(attention_factor)


SCALINGS = {"linear": _linear, "llama3": _llama3, "yarn": _yarn}


def cos_sin(positions: jax.Array, config: ModelConfig, dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, 1, Dh] of the tokens at `positions` [T], angles in float32, rounded to `dtype`."""
    inv_freq, attention_factor = rope_frequencies(config)
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]
    return (jnp.cos(angles) * attention_factor).astype(dtype), (jnp.sin(angles) * attention_factor).astype(
        dtype
    )


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """transformers' rotate-half RoPE on [T, H, Dh] with cos/sin [T, 1, Dh]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(x.dtype)
