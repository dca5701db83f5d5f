"""Gemma 2 (Gemma2ForCausalLM): GeGLU (tanh GELU), RMSNorm scaling by (1 + w), embeddings times sqrt(hidden), a
norm after attention and after the MLP as well as before, soft-capped attention scores and final logits, attention
scaled by `query_pre_attn_scalar`, and sliding-window layers alternating with global ones (`layer_types`).
Gemma 3 (gemma3.py) builds on these."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from jpaged.models.families.family import LAYER, Family, llama_checkpoint, sliding_layers

if TYPE_CHECKING:
    from jpaged.models.config import ModelConfig
    from jpaged.models.params import LeafRecipe

_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh"}  # transformers' names -> ModelConfig.hidden_activation


def gemma_features(hf: Mapping[str, Any], sliding_pattern: int, soft_caps: tuple) -> dict[str, Any]:
    """What Gemma 2 and 3 share. A config without `layer_types` has every `sliding_pattern`-th layer global (as
    transformers fills it in); `soft_caps` are the (attention, final) caps a config without them means."""
    activation = hf.get("hidden_activation") or hf.get("hidden_act", "gelu_pytorch_tanh")
    if activation not in _ACTIVATIONS:
        raise ValueError(
            f"unsupported hidden_activation {activation!r} for Gemma; supported: gelu_pytorch_tanh"
        )
    if hf.get("use_bidirectional_attention"):
        raise ValueError(
            "use_bidirectional_attention (an embedding Gemma) is not a causal LM jpaged generates with"
        )
    return dict(
        sliding_window=hf.get("sliding_window"),
        sliding_layers=sliding_layers(hf, hf.get("sliding_window_pattern", sliding_pattern)),
        norm_offset=1.0,
        hidden_activation=_ACTIVATIONS[activation],
        embed_scale=True,
        post_norms=True,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        attn_logit_softcap=hf.get("attn_logit_softcapping", soft_caps[0]),
        final_logit_softcap=hf.get("final_logit_softcapping", soft_caps[1]),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def gemma_checkpoint(config: ModelConfig) -> dict[str, LeafRecipe]:
    """Llama's names, but transformers' Gemma `post_attention_layernorm` is the norm of attention's output; the
    MLP's input norm is `pre_feedforward_layernorm`."""
    from jpaged.models.params import LeafRecipe

    recipes = llama_checkpoint(config)
    recipes["layers/attn_post_norm/weight"] = LeafRecipe((LAYER + "post_attention_layernorm.weight",))
    recipes["layers/mlp_norm/weight"] = LeafRecipe((LAYER + "pre_feedforward_layernorm.weight",))
    recipes["layers/mlp_post_norm/weight"] = LeafRecipe((LAYER + "post_feedforward_layernorm.weight",))
    return recipes


def gemma_query_scalar(hf: dict[str, Any], layers_27b: int) -> float:
    """llama.cpp keeps no query_pre_attn_scalar in a GGUF: it takes hidden / heads for the 27B models (told by
    their layer count, `layers_27b`) and head_dim for the rest, as Google's gemma_pytorch configs do."""
    if hf["num_hidden_layers"] == layers_27b:
        return hf["hidden_size"] // hf["num_attention_heads"]
    return hf["head_dim"]


def _gguf_config(get, hf, tensors) -> dict[str, Any]:
    return dict(
        sliding_window=get("attention.sliding_window", 4096),
        attn_logit_softcapping=float(get("attn_logit_softcapping", 50.0)),
        final_logit_softcapping=float(get("final_logit_softcapping", 30.0)),
        query_pre_attn_scalar=gemma_query_scalar(hf, layers_27b=46),
    )


FAMILY = Family(
    model_type="gemma2",
    architectures=("Gemma2ForCausalLM",),
    special="GeGLU; (1 + w) RMSNorm before and after attention and MLP; scaled embeddings; attention and final "
    "logit soft-capping; query_pre_attn_scalar; sliding-window layers alternating with global ones",
    features=lambda hf: gemma_features(hf, sliding_pattern=2, soft_caps=(50.0, 30.0)),
    checkpoint=gemma_checkpoint,
    gguf_architecture="gemma2",
    gguf_config=_gguf_config,
)
