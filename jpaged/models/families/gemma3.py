"""Gemma 3, the text models (Gemma3ForCausalLM, model_type `gemma3_text`): Gemma 2 (gemma2.py) with RMSNorm on q
and k, five local layers to one global by default, a RoPE base of their own for the local layers (unscaled) and
the global base with its scaling for the global ones, and no soft-capping."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jpaged.models.families.family import Family
from jpaged.models.families.gemma2 import gemma_checkpoint, gemma_features, gemma_query_scalar


def _features(hf: Mapping[str, Any]) -> dict[str, Any]:
    local = dict((hf.get("rope_parameters") or {}).get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default":
        raise ValueError(
            f"unsupported rope_type {local['rope_type']!r} for Gemma 3's sliding layers; supported: default"
        )
    theta = local.get("rope_theta") or hf.get("rope_local_base_freq", 10000.0)
    features = gemma_features(hf, sliding_pattern=6, soft_caps=(None, None))
    return dict(features, qk_norm=True, local_rope_theta=float(theta))


def _gguf_config(get, hf, tensors) -> dict[str, Any]:
    pattern = get("attention.sliding_window_pattern", 6)
    layers = (
        dict(sliding_window_pattern=pattern)
        if isinstance(pattern, int)
        else dict(layer_types=["sliding_attention" if s else "full_attention" for s in pattern])
    )
    return dict(
        sliding_window=get("attention.sliding_window"),
        rope_local_base_freq=float(get("rope.freq_base_swa", 10000.0)),
        query_pre_attn_scalar=gemma_query_scalar(hf, layers_27b=62),
        **layers,
    )


FAMILY = Family(
    model_type="gemma3_text",
    architectures=("Gemma3ForCausalLM",),
    special="Gemma 2 without soft-capping, with RMSNorm on q and k, five local layers to one global, and a RoPE "
    "base of their own for the local layers",
    features=_features,
    checkpoint=gemma_checkpoint,
    gguf_architecture="gemma3",
    gguf_config=_gguf_config,
)
