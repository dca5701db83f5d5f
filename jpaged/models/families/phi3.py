"""Phi-3 / Phi-3.5 / Phi-4 (Phi3ForCausalLM): Llama whose checkpoint stores q|k|v as one `qkv_proj` and gate|up as
one `gate_up_proj` (the state's own fused column order), with a uniform sliding window when the config sets one,
RoPE on part of head_dim (`partial_rotary_factor`, Phi-4-mini) and LongRoPE (rope.py) on the long-context
models."""

from jpaged.models.families.family import Family, llama_checkpoint

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
)
