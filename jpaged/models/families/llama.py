"""Llama 2/3/3.1 and SmolLM2: the shared decoder as it is."""

from jpaged.models.families.family import Family, llama_checkpoint, window_if_used

FAMILY = Family(
    model_type="llama",
    architectures=("LlamaForCausalLM",),
    special="the shared decoder (RMSNorm, RoPE, SiLU-gated MLP, grouped-query attention)",
    features=lambda hf: dict(
        attention_bias=bool(hf.get("attention_bias", False)), sliding_window=window_if_used(hf)
    ),
    checkpoint=llama_checkpoint,
    gguf_architecture="llama",
    gguf_permutes_qk=True,
)
