"""Mistral: Llama with one sliding window for every layer (when the config sets one)."""

from jpaged.models.families.family import Family, llama_checkpoint

FAMILY = Family(
    model_type="mistral",
    architectures=("MistralForCausalLM",),
    special="uniform sliding window",
    features=lambda hf: dict(
        attention_bias=bool(hf.get("attention_bias", False)), sliding_window=hf.get("sliding_window")
    ),
    checkpoint=llama_checkpoint,
    gguf_permutes_qk=True,  # llama.cpp writes Mistral as its "llama" architecture, which loads as Llama
)
