"""Turn transformers-named weights into the state dict of jpaged's CausalLM (see llama.py for its tree).

Every loader (HF safetensors, GGUF, hub) ends here, so the pytree is the same whatever the source.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
from flax.traverse_util import unflatten_dict
from tqdm.auto import tqdm

from jpaged.models.config import ModelConfig
from jpaged.models.grouped import host_dequantized, is_grouped, joined_columns
from jpaged.models.products import WholeLeaf, is_whole_leaf
from jpaged.models.quantized import QuantizedMatrix

GetTensor = Callable[[str], np.ndarray]  # transformers name -> array in transformers' [out, in] layout


@dataclass(frozen=True)
class LeafRecipe:
    """How one leaf of the state dict comes from transformers tensors: `names` joined along the last axis (in a
    layer's names, "{i}" is the layer), linear weights transposed from transformers' [out, in], a per-expert leaf
    (names with "{j}", the expert) stacked over the experts on a new first axis, and a per-layer leaf stacked over
    the layers on a new first axis before it."""

    names: tuple[str, ...]
    transposed: bool = False
    per_layer: bool = True
    per_expert: bool = False
    interleaved: bool = False  # gate and up in alternate columns (gpt-oss's gate_up): read as gate | up


def hf_recipes(config: ModelConfig) -> dict[str, LeafRecipe]:
    """Every leaf of the state dict (by its "/"-joined path) and the checkpoint tensors it is made of, as the
    config's family names them."""
    from jpaged.models.families import family_of  # the families import LeafRecipe from here

    return family_of(config.architecture).checkpoint(config)


def params_from_hf_names(config: ModelConfig, get: GetTensor, dtype, *, progress: bool = True) -> dict:
    """The CausalLM state dict (numpy, `dtype`) from tensors named as in the family's transformers modules."""
    recipes = hf_recipes(config)

    def read(recipe: LeafRecipe, layer: int | None) -> np.ndarray | WholeLeaf:
        if recipe.per_expert:
            experts = [read_one(recipe, layer, j) for j in range(config.num_experts)]
            return np.stack([dequantized(expert) for expert in experts]).astype(dtype, copy=False)
        return read_one(recipe, layer, None)

    def read_one(recipe: LeafRecipe, layer: int | None, expert: int | None) -> np.ndarray | WholeLeaf:
        parts = [get(name.format(i=layer, j=expert)) for name in recipe.names]
        scalar = lambda part: isinstance(part, np.ndarray) and part.ndim == 0  # noqa: E731 (a per-layer scale)
        parts = [part.reshape(1) if scalar(part) else part for part in parts]
        parts = [part.T for part in parts] if recipe.transposed else parts
        if recipe.interleaved:
            parts = [np.concatenate([part[..., 0::2], part[..., 1::2]], axis=-1) for part in parts]
        if any(isinstance(part, WholeLeaf) for part in parts):
            joined = _joined(parts, [name.format(i=layer, j=expert) for name in recipe.names])
            if joined is not None:
                return joined
            parts = [dequantized(part) for part in parts]
        return np.asarray(np.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0], dtype=dtype)

    flat = {path: read(recipe, None) for path, recipe in recipes.items() if not recipe.per_layer}
    per_layer: dict[str, list[np.ndarray]] = {}
    for i in tqdm(range(config.num_layers), desc="loading layers", disable=not progress, leave=False):
        for path, recipe in recipes.items():
            if recipe.per_layer:
                per_layer.setdefault(path, []).append(read(recipe, i))
    flat.update({path: _stacked(stack, dtype) for path, stack in per_layer.items()})
    return unflatten_dict(flat, sep="/")


def _joined(parts: list, names: list[str]) -> WholeLeaf | None:
    """Quantized matrices [K, N_i] (tensors `names`) side by side as one, or None where they are not all of one
    form. The parts of a fused W8A8 matrix read one input, so their static activation scales join as vLLM joins
    them: the largest, which clips none of the parts' calibrated ranges."""
    if all(isinstance(part, QuantizedMatrix) for part in parts):
        if len({part.values.dtype for part in parts}) > 1:
            return None
        static = [part.input_scale is not None for part in parts]
        if any(static) and not all(static):
            raise ValueError(
                f"{', '.join(names)}: fused matrices mixing static activation scales (input_scale) with "
                "dynamic activations are not supported"
            )
        values, scale = (
            np.concatenate([getattr(part, f) for part in parts], axis=-1) for f in ("values", "scale")
        )
        input_scale = np.max([part.input_scale for part in parts], axis=0) if all(static) else None
        return QuantizedMatrix(values, scale, input_scale)
    return joined_columns(parts)


def _stacked(layers: list, dtype) -> np.ndarray | WholeLeaf:
    """The layers' leaves stacked on a new first axis (a quantized matrix's static activation scales [L, 1, 1]);
    dequantised where they differ in form (a checkpoint that left some layers' matrices unquantized)."""
    structure = {jax.tree_util.tree_structure(layer) for layer in layers}
    if len(structure) > 1:
        layers = [np.asarray(dequantized(layer), dtype) for layer in layers]
    return jax.tree_util.tree_map(lambda *stack: np.stack(stack), *layers)


def dequantized(matrix) -> np.ndarray:
    """The float32 matrix a quantized one stands for (a float one as it is; a static activation scale is the
    activations', not the matrix's, so float activations simply go unquantised)."""
    if is_grouped(matrix):
        return host_dequantized(matrix)
    if isinstance(matrix, QuantizedMatrix):
        return np.asarray(matrix.values, np.float32) * np.asarray(matrix.scale, np.float32)
    return matrix


def param_stats(params: dict) -> tuple[int, int]:
    """(number of parameters, bytes) of a params pytree; a quantized matrix counts a parameter a code."""
    leaves = jax.tree_util.tree_leaves(params, is_leaf=is_whole_leaf)
    count = sum(int(np.prod(np.shape(x))) for x in leaves)
    arrays = jax.tree_util.tree_leaves(params)
    return count, sum(int(x.size) * x.dtype.itemsize for x in arrays)


def random_params(config: ModelConfig, seed: int = 0, dtype=np.float32, std: float = 0.02) -> dict:
    """Freshly initialised weights for `config` (normal with `std`, norms the identity, biases at zero), built through
    the same path as loaded ones: for research code that trains from scratch, demos and tests."""
    rng = np.random.default_rng(seed)
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {
        "embed_tokens.weight": (v, d),
        "lm_head.weight": (v, d),
        "qkv_proj.weight": (q + 2 * kv, d),  # Phi-3's fused q|k|v
        "gate_up_proj.weight": (2 * f, d),  # and gate|up
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
        if config.num_experts and (".experts." in name or "shared_expert" in name or leaf == "gate.weight"):
            return moe_tensor(name, leaf)
        if leaf.endswith("norm.weight"):  # the identity: (offset + w) = 1
            return np.full(shapes.get(leaf, (d,)), 1.0 - config.norm_offset, np.float32)
        if leaf.endswith(".bias"):
            return np.zeros(shapes[leaf], np.float32)
        return (rng.standard_normal(shapes[leaf]) * std).astype(np.float32)

    def moe_tensor(name: str, leaf: str) -> np.ndarray:
        """A mixture of experts' tensors, by the names of transformers' Qwen-MoE and Mixtral blocks."""
        shared = ".shared_expert." in name
        width = config.shared_expert_intermediate_size if shared else config.expert_intermediate_size
        shape = {
            "gate.weight": (config.num_experts, d),
            "shared_expert_gate.weight": (1, d),
            "down_proj.weight": (d, width),
            "w2.weight": (d, width),
        }.get(leaf, (width, d))  # gate_proj / up_proj, Mixtral's w1 / w3
        return (rng.standard_normal(shape) * std).astype(np.float32)

    return params_from_hf_names(config, get, dtype, progress=False)


def weights_spec(params: dict) -> dict:
    """The params' tree with each leaf's shape and dtype only (what the compiled steps depend on)."""
    return jax.tree_util.tree_map(lambda leaf: jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype), params)


def check_same_leaves(expected: dict, given: dict, given_as: str = "the new weights") -> None:
    """`given` must have `expected`'s leaves (same paths, shapes, dtypes; a GroupedMatrix stands for a leaf of its
    shape), so every compiled step takes them; raises ValueError naming the first leaf that differs."""
    flatten = jax.tree_util.tree_flatten_with_path
    ours = {jax.tree_util.keystr(path): leaf for path, leaf in flatten(expected)[0]}
    theirs = {jax.tree_util.keystr(path): leaf for path, leaf in flatten(given, is_leaf=is_whole_leaf)[0]}
    for path, leaf in ours.items():
        if path not in theirs:
            raise ValueError(f"params{path} is missing from {given_as}")
        other = theirs[path]
        shape, dtype = np.shape(other), getattr(other, "dtype", None)
        if isinstance(other, WholeLeaf):  # a quantized matrix stands for a leaf of the model's dtype
            shape, dtype = other.shape, leaf.dtype
        if shape != np.shape(leaf) or dtype != leaf.dtype:
            raise ValueError(
                f"params{path} is {dtype}{list(shape)} in {given_as}, the model's is {leaf.dtype}"
                f"{list(np.shape(leaf))}: weights must keep every leaf's shape and dtype"
            )
    extra = next((path for path in theirs if path not in ours), None)
    if extra is not None:
        raise ValueError(f"params{extra} in {given_as} is not one of the model's weights")
