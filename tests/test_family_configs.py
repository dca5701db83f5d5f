"""How HF config.json files map onto ModelConfig for the families whose configs leave most to transformers'
defaults or carry what jpaged cannot run: Gemma 3 as published (its text model nested, defaults left out) and
Gemma configs jpaged must refuse with a ValueError naming the field."""

from __future__ import annotations

import pytest

from jpaged.models.config import ModelConfig

# google/gemma-3-4b-it's config.json, as published: the text model's fields that differ from the defaults only.
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {"model_type": "siglip_vision_model"},
    "eos_token_id": [1, 106],
}


def test_gemma3_as_published_reads_its_text_model_with_transformers_defaults_filled_in():
    config = ModelConfig.from_hf_config(GEMMA3_4B)
    assert config.architecture == "gemma3"
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (8, 4, 256, 262208)
    assert (config.hidden_size, config.intermediate_size, config.num_layers) == (2560, 10240, 34)
    assert config.sliding_window == 1024
    assert config.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(34))  # five local to one global
    assert config.rope_theta == 1e6 and config.local_rope_theta == 10000.0
    assert config.rope_scaling_dict == {"factor": 8.0, "rope_type": "linear"}
    assert config.query_pre_attn_scalar == 256 and config.qk_norm and config.tie_word_embeddings
    assert config.attn_logit_softcap is None and config.final_logit_softcap is None
    assert config.eos_token_ids == (1, 106)


def gemma2(**fields) -> dict:
    import transformers

    base = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=16
    )
    return {**transformers.Gemma2Config(**base).to_dict(), **fields}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(hidden_activation="relu"), "unsupported hidden_activation 'relu'"),
        (dict(layer_types=["sliding_attention", "chunked_attention"]), r"unsupported layer_types \['chunked"),
        (dict(layer_types=["full_attention"] * 3), "layer_types names 3 layers, the model has 2"),
    ],
)
def test_gemma_configs_jpaged_cannot_run_are_value_errors_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(gemma2(**fields))


def test_an_embedding_gemma_is_refused_as_not_a_causal_lm():
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_config(gemma2(model_type="gemma3_text", use_bidirectional_attention=True))


def test_gemma2_defaults_its_soft_caps_and_alternates_its_layers():
    config = ModelConfig.from_hf_config(gemma2())
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)
    assert config.sliding_layers == (True, False) and config.sliding_window == 4096
    assert config.norm_offset == 1.0 and config.hidden_activation == "gelu_tanh" and config.post_norms
