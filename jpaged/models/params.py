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
