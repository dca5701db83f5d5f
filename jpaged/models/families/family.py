"""What a model family declares: how an HF `config.json` maps onto ModelConfig's features and how its checkpoint's
tensor names map onto the state of the shared decoder (llama.py). One module a family beside this one, each a
`Family` the registry (__init__.py) lists by HF `model_type`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jpaged.models.config import ModelConfig
    from jpaged.models.params import LeafRecipe

LAYER = "model.layers.{i}."
ATTN, MLP = LAYER + "self_attn.", LAYER + "mlp."


@dataclass(frozen=True)
class Family:
    model_type: str  # HF config.json's `model_type`
    architectures: tuple[str, ...]  # HF config.json's `architectures` it names
    special: str  # what sets it apart from Llama, for README's family table
    # HF config.json -> the ModelConfig fields the family sets beyond the shared ones (bias, norms, window...).
    features: Callable[[Mapping[str, Any]], dict[str, Any]]
    # Each state leaf (by its "/"-joined path) and the checkpoint tensors it is made of.
    checkpoint: Callable[[ModelConfig], dict[str, LeafRecipe]]
    rope_aliases: tuple[
        tuple[str, str], ...
    ] = ()  # (the config's rope type, the one it means) for this family
    # A multimodal checkpoint's config.json -> its text model's, which the rest reads (the model served for text).
    text_model: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
    gguf_architecture: str | None = None  # llama.cpp's `general.architecture`, where jpaged reads its GGUF
    gguf_permutes_qk: bool = False  # llama.cpp permuted the Q/K rows for its interleaved RoPE
    # What its GGUF's metadata says beyond the shared keys, as the HF config keys `features` reads: called with
    # (get: metadata key under the architecture -> value, the shared HF keys, its tensors by name, read lazily).
    gguf_config: Callable[[Callable[..., Any], dict[str, Any], Mapping], dict[str, Any]] | None = None

    @property
    def loaders(self) -> tuple[str, ...]:
        return ("HF safetensors", "orbax", *(("GGUF",) if self.gguf_architecture else ()))


def llama_checkpoint(config: ModelConfig, fused_qkv: str | None = None, fused_gate_up: str | None = None):
    """transformers' Llama names: q/k/v and gate/up as separate matrices joined into the state's fused ones, or,
    where the checkpoint stores them fused already (Phi-3), that one matrix: its rows q|k|v and gate|up are the
    state's plain (one-group) column order, so it is read as it is."""
    from jpaged.models.params import LeafRecipe

    qkv_names = (ATTN + fused_qkv,) if fused_qkv else tuple(ATTN + f"{n}_proj.weight" for n in "qkv")
    gate_up_names = (
        (MLP + fused_gate_up,) if fused_gate_up else (MLP + "gate_proj.weight", MLP + "up_proj.weight")
    )
    recipes = {
        "embed/weight": LeafRecipe(("model.embed_tokens.weight",), per_layer=False),
        "final_norm/weight": LeafRecipe(("model.norm.weight",), per_layer=False),
        "layers/attn_norm/weight": LeafRecipe((LAYER + "input_layernorm.weight",)),
        "layers/mlp_norm/weight": LeafRecipe((LAYER + "post_attention_layernorm.weight",)),
        "layers/attn/qkv": LeafRecipe(qkv_names, transposed=True),
        "layers/attn/o": LeafRecipe((ATTN + "o_proj.weight",), transposed=True),
        "layers/mlp/gate_up": LeafRecipe(gate_up_names, transposed=True),
        "layers/mlp/down": LeafRecipe((MLP + "down_proj.weight",), transposed=True),
    }
    if config.attention_bias:
        recipes["layers/attn/qkv_bias"] = LeafRecipe(tuple(ATTN + f"{n}_proj.bias" for n in "qkv"))
    if config.qk_norm:
        recipes["layers/attn/q_norm/weight"] = LeafRecipe((ATTN + "q_norm.weight",))
        recipes["layers/attn/k_norm/weight"] = LeafRecipe((ATTN + "k_norm.weight",))
    if config.kv_cache_scales:
        recipes["layers/attn/kv_scales"] = LeafRecipe((ATTN + "k_scale", ATTN + "v_scale"))
    if not config.tie_word_embeddings:
        recipes["lm_head"] = LeafRecipe(("lm_head.weight",), transposed=True, per_layer=False)
    return recipes


def window_if_used(hf: Mapping[str, Any]) -> int | None:
    """The sliding window where `use_sliding_window` turns it on (Llama, Qwen2/3 configs carry one unused)."""
    return hf.get("sliding_window") if hf.get("use_sliding_window", False) else None


def experts_checkpoint(
    config: ModelConfig, block: str, router: str, experts: tuple[str, str, str], shared: bool = False
) -> dict[str, LeafRecipe]:
    """A mixture of experts' names (models/moe.py): Llama's attention, and in place of its MLP the block `block`
    (after the layer's prefix) of a router `router` and experts "experts.{j}." with gate, up and down matrices
    named `experts`; `shared`: Qwen2-MoE's shared expert and its gate."""
    from jpaged.models.params import LeafRecipe

    recipes = llama_checkpoint(config)
    del recipes["layers/mlp/gate_up"], recipes["layers/mlp/down"]
    moe = LAYER + block
    gate, up, down = (moe + "experts.{j}." + name for name in experts)
    recipes["layers/mlp/router"] = LeafRecipe((moe + router,), transposed=True)
    recipes["layers/mlp/experts_gate_up"] = LeafRecipe((gate, up), transposed=True, per_expert=True)
    recipes["layers/mlp/experts_down"] = LeafRecipe((down,), transposed=True, per_expert=True)
    if shared:
        names = (moe + "shared_expert.gate_proj.weight", moe + "shared_expert.up_proj.weight")
        recipes["layers/mlp/shared_gate_up"] = LeafRecipe(names, transposed=True)
        recipes["layers/mlp/shared_down"] = LeafRecipe(
            (moe + "shared_expert.down_proj.weight",), transposed=True
        )
        recipes["layers/mlp/shared_gate"] = LeafRecipe((moe + "shared_expert_gate.weight",), transposed=True)
    return recipes


def moe_features(hf: Mapping[str, Any], expert_size_key: str = "moe_intermediate_size") -> dict[str, Any]:
    """The mixture-of-experts fields of an HF config every layer of which is sparse (the Qwen-MoE configs'
    `decoder_sparse_step` and `mlp_only_layers` can make some dense: one scanned layer program cannot hold both)."""
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise ValueError(
            "decoder_sparse_step / mlp_only_layers: dense MLP layers among the sparse ones are not supported"
        )
    return dict(
        num_experts=hf.get("num_experts") or hf["num_local_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        expert_intermediate_size=hf[expert_size_key],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )


LAYER_TYPES = ("sliding_attention", "full_attention")


def sliding_layers(hf: Mapping[str, Any], global_every: int) -> tuple[bool, ...] | None:
    """Which layers take the sliding window (Gemma, gpt-oss): the config's `layer_types`, or without them every
    `global_every`-th layer global (as transformers fills them in); None where the config has no window."""
    count = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % global_every else "full_attention" for i in range(count)
    ]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"unsupported layer_types {unknown}; supported: {', '.join(LAYER_TYPES)}")
    return tuple(t == "sliding_attention" for t in types) if hf.get("sliding_window") else None
