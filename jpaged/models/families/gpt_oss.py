"""gpt-oss (GptOssForCausalLM: gpt-oss-20b, -120b): attention with a bias on q, k, v and the output, a learned sink
logit a head, sliding-window layers alternating with global ones, YaRN; a mixture of experts in every layer routed
by the top k of the router's biased logits then a softmax over them, each expert's gate|up (stored interleaved) and
down with biases and a clamped SwiGLU (models/activations.py ClampedSwiGLU). Its released checkpoints store the
experts in MXFP4 (models/mxfp4.py). Chat goes through the harmony format (the server's)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from jpaged.models.families.family import ATTN, MLP, Family, llama_checkpoint, sliding_layers

if TYPE_CHECKING:
    from jpaged.models.config import ModelConfig
    from jpaged.models.params import LeafRecipe


def _features(hf: Mapping[str, Any]) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", True))
    return dict(
        attention_bias=bias,
        attention_output_bias=bias,
        attention_sinks=True,
        norm_scale_in_float32=True,
        sliding_window=hf.get("sliding_window"),
        sliding_layers=sliding_layers(hf, global_every=2),  # transformers' default: even layers slide
        num_experts=hf["num_local_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        expert_intermediate_size=hf["intermediate_size"],
        router="topk_softmax",
        expert_bias=True,
        hidden_activation="clamped_swiglu",
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
    )


def _checkpoint(config: ModelConfig) -> dict[str, LeafRecipe]:
    from jpaged.models.params import LeafRecipe

    recipes = llama_checkpoint(config)
    del recipes["layers/mlp/gate_up"], recipes["layers/mlp/down"]
    experts = MLP + "experts."
    recipes.update(
        {
            "layers/attn/o_bias": LeafRecipe((ATTN + "o_proj.bias",)),
            "layers/attn/sinks": LeafRecipe((ATTN + "sinks",)),
            "layers/mlp/router": LeafRecipe((MLP + "router.weight",), transposed=True),
            "layers/mlp/router_bias": LeafRecipe((MLP + "router.bias",)),
            # [E, D, 2F] and [E, F, D], stored [in, out] already
            "layers/mlp/experts_gate_up": LeafRecipe((experts + "gate_up_proj",), interleaved=True),
            "layers/mlp/experts_gate_up_bias": LeafRecipe((experts + "gate_up_proj_bias",), interleaved=True),
            "layers/mlp/experts_down": LeafRecipe((experts + "down_proj",)),
            "layers/mlp/experts_down_bias": LeafRecipe((experts + "down_proj_bias",)),
        }
    )
    return recipes


FAMILY = Family(
    model_type="gpt_oss",
    architectures=("GptOssForCausalLM",),
    special="mixture of experts (top-k of biased logits, then softmax) with biased experts and a clamped SwiGLU; "
    "attention sinks; sliding-window layers alternating with global ones; MXFP4 experts dequantised at load",
    features=_features,
    checkpoint=_checkpoint,
)
