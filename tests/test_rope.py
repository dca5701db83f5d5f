"""Every RoPE scaling jpaged reads computes transformers' own inverse frequencies and cos/sin scale."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jpaged.models.config import ROPE_SCALINGS, ModelConfig
from jpaged.models.rope import cos_sin, rope_frequencies

BASE = dict(
    vocab_size=128, hidden_size=256, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
    max_position_embeddings=131072, rope_theta=1_000_000.0,
)  # fmt: skip
SCALINGS = {
    "linear": dict(rope_type="linear", factor=4.0),
    "llama3": dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    ),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768),
    "yarn_beta_and_attention_factor": dict(
        rope_type="yarn", factor=8.0, original_max_position_embeddings=4096, beta_fast=16, beta_slow=2,
        attention_factor=0.9,
    ),
    "yarn_mscale": dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=0.7),
    "yarn_untruncated": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768, truncate=False),
}  # fmt: skip


LONGROPE = dict(
    rope_type="longrope",
    short_factor=[1.0 + i / 64 for i in range(64)],
    long_factor=[1.0 + i for i in range(64)],
)
# Sequence-length dependent scalings: (HF config class, scaling, its extra config fields, the original context).
BY_LENGTH = {
    "longrope": (transformers.Phi3Config, LONGROPE, dict(original_max_position_embeddings=4096), 4096),
    "longrope_attention_factor": (
        transformers.Phi3Config, dict(LONGROPE, attention_factor=1.3), dict(original_max_position_embeddings=4096),
        4096,
    ),
    "longrope_partial_rotary": (
        transformers.Phi3Config,
        dict(LONGROPE, short_factor=LONGROPE["short_factor"][:48], long_factor=LONGROPE["long_factor"][:48],
             partial_rotary_factor=0.75),
        dict(original_max_position_embeddings=4096), 4096,
    ),
    "dynamic": (transformers.LlamaConfig, dict(rope_type="dynamic", factor=4.0), {}, 131072),
}  # fmt: skip


@pytest.mark.parametrize("name", SCALINGS)
def test_inverse_frequencies_and_attention_factor_are_transformers(name):
    hf = transformers.Qwen3Config(**BASE, rope_scaling=SCALINGS[name])
    expected_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS[SCALINGS[name]["rope_type"]](hf, "cpu")
    inv_freq, factor = rope_frequencies(ModelConfig.from_hf_config(hf.to_dict()))
    np.testing.assert_allclose(inv_freq, expected_inv_freq.numpy(), rtol=1e-6)
    assert factor == pytest.approx(expected_factor, rel=1e-6)


@pytest.mark.parametrize("side", ["below", "at", "above"])
@pytest.mark.parametrize("name", BY_LENGTH)
def test_length_dependent_frequencies_are_transformers_below_and_above_the_original_context(name, side):
    config_class, scaling, extra, original = BY_LENGTH[name]
    seq_len = {"below": original // 3, "at": original, "above": original * 3 + 5}[side]
    hf = config_class(**BASE, **extra, rope_scaling=scaling)
    expected_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu", seq_len=seq_len)
    config = ModelConfig.from_hf_config(hf.to_dict())
    inv_freq, factor = rope_frequencies(config, seq_len)
    np.testing.assert_allclose(inv_freq, expected_inv_freq.numpy(), rtol=1e-6)
    assert factor == pytest.approx(expected_factor, rel=1e-6)
    # Per token inside the jitted step: a token whose rope length is seq_len gets the same frequencies.
    positions = jnp.asarray([0, 1, 7, 31], jnp.int32)  # small: float32 angles of large ones differ by ~1e-4
    cos, sin = cos_sin(positions, config, jnp.float32, jnp.full(4, seq_len, jnp.int32))
    angles = np.asarray(positions, np.float32)[:, None] * expected_inv_freq.numpy()[None, :]
    angles = np.concatenate([angles, angles], axis=-1).astype(np.float64)
    np.testing.assert_allclose(np.asarray(cos)[:, 0], np.cos(angles) * expected_factor, atol=2e-5)
    np.testing.assert_allclose(np.asarray(sin)[:, 0], np.sin(angles) * expected_factor, atol=2e-5)


def test_tokens_of_one_step_each_get_their_own_rope_length():
    """A prefill below the original context and a decode past it share a step: short and long factors."""
    config_class, scaling, extra, original = BY_LENGTH["longrope"]
    config = ModelConfig.from_hf_config(config_class(**BASE, **extra, rope_scaling=scaling).to_dict())
    positions = jnp.asarray([5, 5], jnp.int32)
    cos, _ = cos_sin(positions, config, jnp.float32, jnp.asarray([original, original + 1], jnp.int32))
    (short, factor), (long, _) = (rope_frequencies(config, n) for n in (original, original + 1))
    assert not np.allclose(short, long)
    expected = np.cos(5.0 * np.stack([short, long]).astype(np.float64)) * factor
    np.testing.assert_allclose(np.asarray(cos)[:, 0, :64], expected, atol=2e-5)


def test_every_scaling_type_the_config_accepts_is_tested_here():
    tested = {s["rope_type"] for s in SCALINGS.values()} | {
        s["rope_type"] for _, s, _, _ in BY_LENGTH.values()
    }
    assert tested == set(ROPE_SCALINGS)


def test_an_unsupported_scaling_type_is_a_value_error_naming_the_supported_ones():
    hf = dict(transformers.Qwen3Config(**BASE).to_dict(), rope_scaling=dict(rope_type="fope", factor=2.0))
    with pytest.raises(ValueError, match="'fope'.*longrope"):
        ModelConfig.from_hf_config(hf)


@pytest.mark.parametrize("alias", ["su", "yarn"])
def test_phi3_reads_its_legacy_rope_type_names_as_longrope_as_transformers_does(alias):
    config_class, scaling, extra, _ = BY_LENGTH["longrope"]
    hf = config_class(**BASE, **extra, rope_scaling=scaling).to_dict()
    hf["rope_parameters"] = dict(hf["rope_parameters"], rope_type=alias)
    assert ModelConfig.from_hf_config(hf).rope_scaling_dict["rope_type"] == "longrope"
    other = dict(transformers.Qwen3Config(**BASE, rope_scaling=SCALINGS["yarn"]).to_dict())
    assert ModelConfig.from_hf_config(other).rope_scaling_dict["rope_type"] == "yarn"  # only Phi-3's alias
