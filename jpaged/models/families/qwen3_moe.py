"""Qwen3-MoE (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention and a mixture of experts in
every layer, routed by a softmax over the experts then the top k (renormalised where `norm_topk_prob`)."""

from jpaged.models.families.family import Family, experts_checkpoint, moe_features, window_if_used

FAMILY = Family(
    model_type="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    special="mixture of experts (softmax then top-k); RMSNorm on q and k",
    features=lambda hf: dict(
        attention_bias=bool(hf.get("attention_bias", False)),
        qk_norm=True,
        sliding_window=window_if_used(hf),
        **moe_features(hf),
    ),
    checkpoint=lambda config: experts_checkpoint(
        config, "mlp.", "gate.weight", ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
    ),
)
