"""Qwen2 / Qwen2.5: Llama with a bias on the q, k and v projections."""

from jpaged.models.families.family import Family, llama_checkpoint, window_if_used

FAMILY = Family(
    model_type="qwen2",
    architectures=("Qwen2ForCausalLM",),
    special="bias on q, k, v",
    features=lambda hf: dict(attention_bias=True, sliding_window=window_if_used(hf)),
    checkpoint=llama_checkpoint,
    gguf_architecture="qwen2",
)
