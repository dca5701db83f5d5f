"""Every RoPE scaling jpaged reads computes transformers' own inverse frequencies and cos/sin scale."""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jpaged.models.config import ROPE_SCALINGS, ModelConfig
from jpaged.models.rope import rope_frequencies

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


@pytest.mark.parametrize("name", SCALINGS)
def test_inverse_frequencies_and_attention_factor_are_transformers(name):
    hf = transformers.Qwen3Config(**BASE, rope_scaling=SCALINGS[name])
    expected_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS[SCALINGS[name]["rope_type"]](hf, "cpu")
    inv_freq, factor = rope_frequencies(ModelConfig.from_hf_config(hf.to_dict()))
    np.testing.assert_allclose(inv_freq, expected_inv_freq.numpy(), rtol=1e-6)
    assert factor == pytest.approx(expected_factor, rel=1e-6)


def test_every_scaling_type_the_config_accepts_is_tested_here():
    assert {s["rope_type"] for s in SCALINGS.values()} == set(ROPE_SCALINGS)


def test_an_unsupported_scaling_type_is_a_value_error_naming_the_supported_ones():
    hf = transformers.Qwen3Config(
        **BASE, rope_scaling=dict(rope_type="longrope", short_factor=[1.0], long_factor=[1.0])
    )
    with pytest.raises(ValueError, match="'longrope'.*yarn"):
        ModelConfig.from_hf_config(hf.to_dict())
