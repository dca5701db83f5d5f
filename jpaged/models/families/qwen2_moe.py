"""Qwen2-MoE (Qwen2MoeForCausalLM: Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (bias on q, k, v) and a mixture
of experts in every layer beside a shared expert every token takes, scaled by a sigmoid of its own gate."""

from jpaged.models.families.family import Family, experts_checkpoint, moe_features, window_if_used

FAMILY = Family(
    model_type="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    special="mixture of experts (softmax then top-k) with a gated shared expert; bias on q, k, v",
    features=lambda hf: dict(
        attention_bias=bool(hf.get("qkv_bias", True)),
        sliding_window=window_if_used(hf),
        shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
        **moe_features(hf),
    ),
    checkpoint=lambda config: experts_checkpoint(
        config,
        "mlp.",
        "gate.weight",
        ("gate_proj.weight", "up_proj.weight", "down_proj.weight"),
        shared=True,
    ),
)
