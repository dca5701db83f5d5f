"""Mixtral (MixtralForCausalLM: Mixtral-8x7B, 8x22B): Mistral's attention and a mixture of experts of
`intermediate_size` in every layer, top-k of a softmax over the experts, always renormalised."""

from jpaged.models.families.family import Family, experts_checkpoint, moe_features

FAMILY = Family(
    model_type="mixtral",
    architectures=("MixtralForCausalLM",),
    special="mixture of experts (softmax, top-k, renormalised); uniform sliding window",
    features=lambda hf: {
        **moe_features(hf, expert_size_key="intermediate_size"),
        "sliding_window": hf.get("sliding_window"),
        "norm_topk_prob": True,
    },
    checkpoint=lambda config: experts_checkpoint(
        config, "block_sparse_moe.", "gate.weight", ("w1.weight", "w3.weight", "w2.weight")
    ),
)
