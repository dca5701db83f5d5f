"""Architecture description shared by every loader: one frozen, hashable record per model.

It is a static argument of the jitted step, so it holds only hashable values (tuples, not lists or dicts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

ROPE_SCALINGS = ("linear", "llama3", "yarn", "longrope", "dynamic")  # rope.py's SCALINGS computes each
# The scalings whose frequencies depend on the sequence's length (the rest are fixed per model).
LENGTH_DEPENDENT_ROPE = ("longrope", "dynamic")
# The gated MLP's activations by transformers' `hidden_act` names (llama.py's ACTIVATIONS computes each).
HIDDEN_ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu")  # the last: gpt-oss's experts (activations.py)
ROUTERS = ("softmax_topk", "topk_softmax")  # experts.route: Qwen-MoE's and Mixtral's; gpt-oss's


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on the q, k and v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None  # Mistral
    rotary_dim: int | None = (
        None  # RoPE on the first rotary_dim of head_dim only (Phi-4-mini); None: all of it
    )
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # sorted (key, value) pairs, e.g. llama3 scaling
    # Which layers `sliding_window` applies to (Gemma 2/3 alternate local and global layers); None: all of them.
    sliding_layers: tuple[bool, ...] | None = None
    local_rope_theta: float | None = (
        None  # RoPE base of the sliding layers, unscaled (Gemma 3); None: rope_theta
    )
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w), in float32 (Gemma: 1)
    norm_scale_in_float32: bool = False  # RMSNorm scales by w in float32 too, before rounding (gpt-oss)
    hidden_activation: str = "silu"  # of the gated MLP: "silu" or "gelu_tanh" (Gemma's GeGLU)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    post_norms: bool = (
        False  # RMSNorm after attention and after the MLP too, before each residual add (Gemma)
    )
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power; None: head_dim's (Gemma)
    attn_logit_softcap: float | None = None  # cap * tanh(score / cap) on attention scores (Gemma 2)
    final_logit_softcap: float | None = None  # and on the final logits
    # Per-layer scales of K and V for float8 pages, read from the checkpoint (compressed-tensors' kv_cache_scheme)
    kv_cache_scales: bool = False
    # Mixture of experts (models/moe.py): every layer's MLP is `num_experts` experts of `expert_intermediate_size`,
    # each token taking its top `num_experts_per_tok`; 0 experts: a dense MLP of `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum to 1 (Mixtral, Qwen3-MoE)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert every token takes (0: none)
    router: str = "softmax_topk"  # how a token's experts and weights come from the router's logits (ROUTERS)
    expert_bias: bool = False  # a bias on the router's logits and on each expert's gate_up and down (gpt-oss)
    swiglu_limit: float = 0.0  # clamped_swiglu's clamp of gate and up, and its sigmoid's slope (gpt-oss)
    swiglu_alpha: float = 0.0
    attention_sinks: bool = False  # a learned logit a query head adds to its softmax's denominator (gpt-oss)
    attention_output_bias: bool = False  # a bias on the attention's output projection (gpt-oss)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        from jpaged.models.families import family_of  # the families import this module

        family_of(self.architecture)
        if self.hidden_activation not in HIDDEN_ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_activation {self.hidden_activation!r}; supported: "
                f"{', '.join(HIDDEN_ACTIVATIONS)}"
            )
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise ValueError(
                f"layer_types names {len(self.sliding_layers)} layers, the model has {self.num_layers}"
            )
        if self.router not in ROUTERS:
            raise ValueError(f"unsupported router {self.router!r}; supported: {', '.join(ROUTERS)}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and num_experts "
                f"({self.num_experts})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def rope_depends_on_length(self) -> bool:
        """A token's rotation depends on its sequence's length: a cached prefix computed for another length
        would not be this request's keys."""
        return bool(self.rope_scaling) and self.rope_scaling_dict["rope_type"] in LENGTH_DEPENDENT_ROPE

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def to_json_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["rope_scaling"] = self.rope_scaling_dict
        out["eos_token_ids"] = list(self.eos_token_ids)
        out["sliding_layers"] = None if self.sliding_layers is None else list(self.sliding_layers)
        return out

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in fields}
        kwargs["rope_scaling"] = _freeze(kwargs.get("rope_scaling"))
        kwargs["eos_token_ids"] = tuple(kwargs.get("eos_token_ids", ()))
        if kwargs.get("sliding_layers") is not None:
            kwargs["sliding_layers"] = tuple(kwargs["sliding_layers"])
        return cls(**kwargs)

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Build from a transformers `config.json` dict (old `rope_theta`/`rope_scaling` or new `rope_parameters`)."""
        from jpaged.models.families import family_of

        model_type = hf.get("model_type", "")
        family = family_of(model_type, hf.get("architectures"))
        if family.text_model is not None:
            hf = family.text_model(hf)
        num_heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or {})
        rope = dict(rope.get("full_attention", rope))  # per layer type (Gemma 3): the global layers' RoPE
        rope_theta = rope.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
        partial_rotary_factor = rope.pop("partial_rotary_factor", None) or hf.get(
            "partial_rotary_factor", 1.0
        )
        scaling = dict(hf.get("rope_scaling") or rope)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        rope_type = dict(family.rope_aliases).get(rope_type, rope_type)
        if rope_type == "default":
            scaling = {}
        elif rope_type not in ROPE_SCALINGS:
            raise ValueError(
                f"unsupported rope_scaling type {rope_type!r}; supported: default, {', '.join(ROPE_SCALINGS)}"
            )
        scaling.pop("type", None)
        if rope_type == "longrope" and "original_max_position_embeddings" not in scaling:
            scaling["original_max_position_embeddings"] = hf[
                "original_max_position_embeddings"
            ]  # Phi-3's place
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rotary_dim = int(head_dim * partial_rotary_factor)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        shared = dict(
            architecture=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rotary_dim=rotary_dim if rotary_dim < head_dim else None,
            rope_scaling=_freeze({**scaling, "rope_type": rope_type}) if scaling else None,
            kv_cache_scales=bool((hf.get("quantization_config") or {}).get("kv_cache_scheme")),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
        return cls(**{**shared, **family.features(hf)})


def _freeze(mapping: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    if not mapping:
        return None
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in mapping.items()))
