"""Phi-3 / Phi-3.5 / Phi-4 (Phi3ForCausalLM): Llama whose checkpoint stores q|k|v as one `qkv_proj` and gate|up as
one `gate_up_proj` (the state's own fused column order), with a uniform sliding window when the config sets one,
RoPE on part of head_dim (`partial_rotary_factor`, Phi-4-mini) and LongRoPE (rope.py) on the long-context
models."""

import math

from jpaged.models.families.family import Family, llama_checkpoint


def _gguf_config(get, hf, tensors) -> dict:
    # The checkpoint's window, as jpaged reads it from an HF config (llama.cpp's converter writes 0 for none, as
    # Phi-4). llama.cpp itself runs Phi-3 without it for now and transformers' GGUF loading drops it.
    config = dict(sliding_window=get("attention.sliding_window") or None)
    if "rope_factors_long.weight" in tensors:
        config.update(_gguf_longrope(get, hf, tensors))
    return config


def _gguf_longrope(get, hf, tensors) -> dict:
    """LongRoPE as llama.cpp's converter stores it (transformers' GGUF loading drops it): the factors as tensors,
    the original context, and the attention factor computed from the two contexts as transformers computes it when
    the config gives none, so the config names one only where the file's differs."""
    original = get("rope.scaling.original_context_length")
    scaling = dict(
        rope_type="longrope",
        long_factor=[float(f) for f in tensors["rope_factors_long.weight"]],
        short_factor=[float(f) for f in tensors["rope_factors_short.weight"]],
        original_max_position_embeddings=original,
    )
    scale = hf["max_position_embeddings"] / original
    derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    stored = get("rope.scaling.attn_factor")
    if stored is not None and not math.isclose(stored, derived, rel_tol=1e-6):
        scaling["attention_factor"] = float(stored)
    return dict(rope_scaling=scaling, original_max_position_embeddings=original)


FAMILY = Family(
    model_type="phi3",
    architectures=("Phi3ForCausalLM",),
    special="checkpoint's fused qkv_proj and gate_up_proj; LongRoPE; partial rotary (Phi-4-mini); uniform "
    "sliding window",
    features=lambda hf: dict(sliding_window=hf.get("sliding_window")),
    checkpoint=lambda config: llama_checkpoint(
        config, fused_qkv="qkv_proj.weight", fused_gate_up="gate_up_proj.weight"
    ),
    # transformers' Phi3Config reads both as LongRoPE ("su": the first Phi-3 releases' name).
    rope_aliases=(("su", "longrope"), ("yarn", "longrope")),
    gguf_architecture="phi3",
    gguf_config=_gguf_config,
)
