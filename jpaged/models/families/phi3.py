"""Phi-3 / Phi-3.5 / Phi-4 (Phi3ForCausalLM): Llama whose checkpoint stores q|k|v as one `qkv_proj` and gate|up as
one `gate_up_proj` (the state's own fused column order), with a uniform sliding window when the config sets one,
RoPE on part of head_dim (`partial_rotary_factor`, Phi-4-mini) and LongRoPE (rope.py) on the long-context
models."""

from jpaged.models.families.family import Family, llama_checkpoint


def _gguf_config(get, hf, tensors) -> dict:
    if "rope_factors_long.weight" in tensors:
        # llama.cpp stores LongRoPE's factors as tensors; transformers' GGUF loading drops them (and with them the
        # model's RoPE at every length), so jpaged refuses rather than run a different model.
        raise ValueError(
            "phi3 GGUF with LongRoPE (rope_factors_long/rope_factors_short tensors) is not supported; load the "
            "HF checkpoint instead"
        )
    # The checkpoint's window, as jpaged reads it from an HF config (llama.cpp's converter writes 0 for none, as
    # Phi-4). llama.cpp itself runs Phi-3 without it for now and transformers' GGUF loading drops it.
    return dict(sliding_window=get("attention.sliding_window") or None)


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
