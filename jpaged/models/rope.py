"""Rotary position embeddings as transformers computes them: the inverse frequencies (with linear, llama3, YaRN,
LongRoPE or dynamic NTK scaling, SCALINGS), each token's cos/sin, and the rotate-half rotation (of the first
`rotary_dim` of each head where the config says, as Phi-4-mini).

LongRoPE and dynamic NTK depend on the sequence length in transformers (modeling_rope_utils'
`dynamic_rope_update`): a forward over a sequence whose largest position + 1 exceeds the original context uses the
long factors (LongRoPE) or a base scaled to that length (dynamic). HF's generate runs the prompt in one forward,
then one token a step, so a token's frequencies follow its *rope length*, max(its sequence's prompt length, its
position + 1): `StepBatch.rope_lengths`, which the runner fills per token, so chunked prefill and decode rotate
each token as transformers' generate does, and its cached K keeps that rotation.

vLLM differs for LongRoPE (Phi3LongRoPEScaledRotaryEmbedding): it picks one factor set for the whole server, the
long factors whenever max_model_len exceeds original_max_position_embeddings, so that no cached K was rotated
with the other set; for prompts shorter than the original context it is then off transformers' path. Ours is on
it, at the price that a prefix cached from a short sequence (short factors) and reused by a long prompt (long
factors) differs from what transformers computes for that prompt (exact when no prefix is reused).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Rotary inverse frequencies [Dh / 2] under the config's scaling, as transformers computes them."""
    return rope_frequencies(config)[0]


def rotary_dim(config: ModelConfig) -> int:
    """How much of each head RoPE rotates (its first rotary_dim; all of head_dim unless the config says)."""
    return config.rotary_dim or config.head_dim


def rope_frequencies(config: ModelConfig, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """Inverse frequencies [rotary_dim / 2] and the factor cos and sin are scaled by (YaRN's or LongRoPE's
    attention factor, else 1), for a forward over `seq_len` tokens as transformers' ROPE_INIT_FUNCTIONS compute
    them (only LongRoPE and dynamic NTK depend on it; None: as at initialisation)."""
    dim = rotary_dim(config)
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling_dict
    if not scaling:
        return inv_freq.astype(np.float32), 1.0
    inv_freq, attention_factor = SCALINGS[scaling["rope_type"]](inv_freq, scaling, config, seq_len)
    return inv_freq.astype(np.float32), attention_factor


def _linear(
    inv_freq: np.ndarray, scaling: dict, config: ModelConfig, seq_len=None
) -> tuple[np.ndarray, float]:
    return inv_freq / scaling["factor"], 1.0


def _llama3(
    inv_freq: np.ndarray, scaling: dict, config: ModelConfig, seq_len=None
) -> tuple[np.ndarray, float]:
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


def _yarn(inv_freq: np.ndarray, scaling: dict, config: ModelConfig, seq_len=None) -> tuple[np.ndarray, float]:
    """YaRN (Qwen2.5/Qwen3 past 32k): interpolate the slow dimensions by the factor, keep the fast ones, ramp
    linearly between the dimensions that turn beta_fast and beta_slow times over the original context; cos and sin
    scaled by the attention factor."""
    dim, base = rotary_dim(config), config.rope_theta
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


def _longrope(
    inv_freq: np.ndarray, scaling: dict, config: ModelConfig, seq_len=None
) -> tuple[np.ndarray, float]:
    """LongRoPE (Phi-3/3.5/4): each frequency divided by its own factor, the short factors up to the original
    context and the long ones past it; cos and sin scaled by sqrt(1 + ln(factor) / ln(original)) unless the
    config gives the attention factor."""
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / old_len
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    long = seq_len is not None and seq_len > old_len
    factors = np.asarray(scaling["long_factor" if long else "short_factor"], np.float64)
    return inv_freq / factors, float(attention_factor)


def _dynamic_base(config: ModelConfig, seq_len):
    """Dynamic NTK's base for a forward over `seq_len` tokens (numpy or jax, scalar or per token): the base grown
    so that the slowest frequency stretches over seq_len, from max_position_embeddings on."""
    factor, old_len = config.rope_scaling_dict["factor"], config.max_position_embeddings
    dim = rotary_dim(config)
    seq_len = jnp.maximum(seq_len, old_len) if isinstance(seq_len, jax.Array) else max(seq_len or 0, old_len)
    return config.rope_theta * ((factor * seq_len / old_len) - (factor - 1)) ** (dim / (dim - 2))


def _dynamic(
    inv_freq: np.ndarray, scaling: dict, config: ModelConfig, seq_len=None
) -> tuple[np.ndarray, float]:
    dim = rotary_dim(config)
    return 1.0 / (_dynamic_base(config, seq_len) ** (np.arange(0, dim, 2, dtype=np.float64) / dim)), 1.0


SCALINGS = {"linear": _linear, "llama3": _llama3, "yarn": _yarn, "longrope": _longrope, "dynamic": _dynamic}


def _token_inv_freq(config: ModelConfig, rope_lengths: jax.Array) -> jax.Array:
    """Each token's inverse frequencies [T, rotary_dim / 2] from its rope length (see the module's docstring)."""
    scaling = config.rope_scaling_dict
    if scaling["rope_type"] == "longrope":
        old_len = scaling["original_max_position_embeddings"]
        short, long = (jnp.asarray(rope_frequencies(config, n)[0]) for n in (old_len, old_len + 1))
        return jnp.where((rope_lengths > old_len)[:, None], long[None, :], short[None, :])
    dim = rotary_dim(config)
    base = _dynamic_base(config, rope_lengths.astype(jnp.float32))
    return 1.0 / (base[:, None] ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)[None, :])


def cos_sin(
    positions: jax.Array, config: ModelConfig, dtype, rope_lengths: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, 1, rotary_dim] of the tokens at `positions` [T], angles in float32, rounded to `dtype`.
    `rope_lengths` [T] (None: position + 1) matter to the sequence-length dependent scalings only."""
    inv_freq, attention_factor = rope_frequencies(config)
    if config.rope_depends_on_length:
        lengths = positions + 1 if rope_lengths is None else rope_lengths
        inv_freq = _token_inv_freq(config, lengths)
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]
    return (jnp.cos(angles) * attention_factor).astype(dtype), (jnp.sin(angles) * attention_factor).astype(
        dtype
    )


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """transformers' rotate-half RoPE on [T, H, Dh] with cos/sin [T, 1, R]: the first R of Dh rotated, the rest
    passed through (partial rotary)."""
    width = cos.shape[-1]
    if width < x.shape[-1]:
        return jnp.concatenate([rotate(x[..., :width], cos, sin), x[..., width:]], axis=-1)
    half = width // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(x.dtype)
