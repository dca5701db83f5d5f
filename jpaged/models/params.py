"""Turn transformers-named weights into jpaged's params pytree (see llama.py for its layout).

Every loader (HF safetensors, GGUF, hub) ends here, so the pytree is the same whatever the source.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from tqdm.auto import tqdm

from jpaged.models.config import ModelConfig

GetTensor = Callable[[str], np.ndarray]  # transformers name -> array in transformers' [out, in] layout


def params_from_hf_names(config: ModelConfig, get: GetTensor, dtype, *, progress: bool = True) -> dict:
    """Build the params pytree (numpy, `dtype`) from tensors named as in transformers' Llama/Qwen modules."""

    def linear(name: str) -> np.ndarray:  # [out, in] -> [in, out]
        return get(name).T

    per_layer: dict[str, list[np.ndarray]] = {}

    def add(key: str, value: np.ndarray) -> None:
        per_layer.setdefault(key, []).append(np.asarray(value, dtype=dtype))

    for i in tqdm(range(config.num_layers), desc="loading layers", disable=not progress, leave=False):
        p = f"model.layers.{i}."
        add("attn_norm", get(p + "input_layernorm.weight"))
        add("mlp_norm", get(p + "post_attention_layernorm.weight"))
        qkv = [linear(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
        add("w_qkv", np.concatenate(qkv, axis=1))
        if config.attention_bias:
            add("b_qkv", np.concatenate([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
        if config.qk_norm:
            add("q_norm", get(p + "self_attn.q_norm.weight"))
            add("k_norm", get(p + "self_attn.k_norm.weight"))
        add("wo", linear(p + "self_attn.o_proj.weight"))
        add(
            "w_gate_up",
            np.concatenate([linear(p + "mlp.gate_proj.weight"), linear(p + "mlp.up_proj.weight")], 1),
        )
        add("w_down", linear(p + "mlp.down_proj.weight"))

    params = {
        "embed": np.asarray(get("model.embed_tokens.weight"), dtype=dtype),
        "final_norm": np.asarray(get("model.norm.weight"), dtype=dtype),
        "layers": {k: np.stack(v) for k, v in per_layer.items()},
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = np.asarray(linear("lm_head.weight"), dtype=dtype)
    return params


def param_stats(params: dict) -> tuple[int, int]:
    """(number of parameters, bytes) of a params pytree."""
    leaves = jax.tree_util.tree_leaves(params)
    return sum(int(x.size) for x in leaves), sum(int(x.size) * x.dtype.itemsize for x in leaves)


def random_params(config: ModelConfig, seed: int = 0, dtype=np.float32, std: float = 0.02) -> dict:
    """Freshly initialised weights for `config` (normal with `std`, norms at one, biases at zero), built through
    the same path as loaded ones: for research code that trains from scratch, demos and tests."""
    rng = np.random.default_rng(seed)
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {
        "embed_tokens.weight": (v, d),
        "lm_head.weight": (v, d),
        "q_proj.weight": (q, d),
        "k_proj.weight": (kv, d),
        "v_proj.weight": (kv, d),
        "o_proj.weight": (d, q),
        "gate_proj.weight": (f, d),
        "up_proj.weight": (f, d),
        "down_proj.weight": (d, f),
        "q_proj.bias": (q,),
        "k_proj.bias": (kv,),
        "v_proj.bias": (kv,),
        "q_norm.weight": (config.head_dim,),
        "k_norm.weight": (config.head_dim,),
    }

    def get(name: str) -> np.ndarray:
        leaf = ".".join(name.split(".")[-2:])
        if leaf.endswith("norm.weight") and leaf not in shapes:  # input/post-attention/final norms
            return np.ones(d, np.float32)
        if leaf.endswith("norm.weight"):
            return np.ones(shapes[leaf], np.float32)
        if leaf.endswith(".bias"):
            return np.zeros(shapes[leaf], np.float32)
        return (rng.standard_normal(shapes[leaf]) * std).astype(np.float32)

    return params_from_hf_names(config, get, dtype, progress=False)
