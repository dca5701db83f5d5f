"""Qwen3 (dense): Llama with RMSNorm over head_dim on q and k before RoPE."""

from jpaged.models.families.family import Family, llama_checkpoint, window_if_used

FAMILY = Family(
    model_type="qwen3",
    architectures=("Qwen3ForCausalLM",),
    special="RMSNorm on q and k (per head)",
    features=lambda hf: dict(
        attention_bias=bool(hf.get("attention_bias", False)), qk_norm=True, sliding_window=window_if_used(hf)
    ),
    checkpoint=llama_checkpoint,
    gguf_architecture="qwen3",
)
