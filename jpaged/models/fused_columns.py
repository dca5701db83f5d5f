"""Fused matrices' columns (q|k|v of the QKV projection and its bias, gate|up of the MLP, of each expert and of
the shared expert) and how they are grouped for tensor parallelism: in `groups` runs, run g holding shard g's part
of every part, so that each shard's columns are whole heads of q, k and v and matching columns of gate and up. One
group is the loaders' plain concatenation."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.models.config import ModelConfig

# Each fused leaf by its path in a DecoderLayer's state, and the fused_sizes entry its columns follow.
FUSED_LEAVES = {
    ("attn", "qkv"): "qkv",
    ("attn", "qkv_bias"): "qkv",
    ("mlp", "gate_up"): "gate_up",
    ("mlp", "experts_gate_up"): "experts_gate_up",
    ("mlp", "experts_gate_up_bias"): "experts_gate_up",
    ("mlp", "shared_gate_up"): "shared_gate_up",
}


def fused_sizes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The parts of each fused matrix's columns: q, k, v of qkv (and its bias); gate, up of gate_up, and of a
    mixture of experts' experts_gate_up (each expert's) and shared_gate_up (models/moe.py)."""
    kv = config.num_kv_heads * config.head_dim
    sizes = {"qkv": (config.num_heads * config.head_dim, kv, kv), "gate_up": (config.intermediate_size,) * 2}
    if config.num_experts:
        sizes["experts_gate_up"] = (config.expert_intermediate_size,) * 2
    if config.shared_expert_intermediate_size:
        sizes["shared_gate_up"] = (config.shared_expert_intermediate_size,) * 2
    return sizes


def fused_leaves(layers: dict) -> dict[tuple[str, str], str]:
    """The FUSED_LEAVES a model's layers (its state's "layers" tree, or any tree of some of its leaves) hold."""
    return {path: sizes for path, sizes in FUSED_LEAVES.items() if path[1] in layers.get(path[0], {})}


def split_fused(x: jax.Array, sizes: tuple[int, ...], groups: int) -> list[jax.Array]:
    """The parts of fused columns x [T, sum(sizes)] laid out as `groups` runs of [part 0, part 1, ...] (each
    part's columns in order across the runs); `groups` 1 is the loaders' plain concatenation."""
    grouped = x.reshape(*x.shape[:-1], groups, sum(sizes) // groups)
    bounds = np.cumsum([size // groups for size in sizes])[:-1]
    return [part.reshape(*x.shape[:-1], -1) for part in jnp.split(grouped, bounds, axis=-1)]


def along_columns(array, weight) -> bool:
    """Whether `array` (a weight, or one of a quantized matrix's (models.products.WholeLeaf) arrays) runs along the
    weight's columns: its codes and its scales and biases per column do, a per-tensor scale does not."""
    return np.shape(array)[-1] == weight.shape[-1]


def by_columns(function: Callable[[jax.Array], jax.Array], weight):
    """`function` (a rearrangement of the last axis) applied to a weight's columns: a float matrix's, or those of a
    quantized matrix's arrays that run along them (the others left as they are)."""
    return jax.tree_util.tree_map(lambda a: function(a) if along_columns(a, weight) else a, weight)


def group_fused_columns(params: dict, config: ModelConfig, groups: int) -> dict:
    """The loaders' params (or any tree of some of their layers' leaves) with the fused matrices' (and the QKV
    bias') columns in `groups` runs, as `split_fused` reads them: run g holds part g of every part's columns (for
    tensor parallelism, shard g)."""
    sizes = fused_sizes(config)

    def regroup(x, parts):
        pieces = jnp.split(jnp.asarray(x), np.cumsum(parts)[:-1], axis=-1)
        runs = [piece.reshape(*piece.shape[:-1], groups, -1) for piece in pieces]
        return jnp.concatenate(runs, axis=-1).reshape(*x.shape)

    grouped = jax.tree_util.tree_map(lambda leaf: leaf, params)  # new dicts, the same arrays
    for (parent, name), part in fused_leaves(grouped["layers"]).items():
        parts = sizes[part]
        if any(size % groups for size in parts):
            raise ValueError(f"{groups} shards do not divide the {part} parts {parts}")
        node = grouped["layers"][parent]
        node[name] = by_columns(functools.partial(regroup, parts=parts), node[name])
    return grouped


def replicate_kv_heads(params: dict, config: ModelConfig, copies: int) -> dict:
    """The loaders' params with each KV head's k and v columns (and bias) repeated `copies` times in place: the
    weights of the same model with `copies` times the KV heads, each query head still reading its own (query head
    q reads KV head q // (heads / KV heads) either way). For tensor parallelism over more devices than KV heads."""
    q, k, v = fused_sizes(config)["qkv"]
    head_dim = config.head_dim

    def repeat(x):
        x = jnp.asarray(x)
        query, keys, values = jnp.split(x, [q, q + k], axis=-1)
        heads = [part.reshape(*x.shape[:-1], -1, head_dim) for part in (keys, values)]
        repeated = [jnp.repeat(part, copies, axis=-2).reshape(*x.shape[:-1], -1) for part in heads]
        return jnp.concatenate([query, *repeated], axis=-1)

    replicated = jax.tree_util.tree_map(lambda leaf: leaf, params)  # new dicts, the same arrays
    attn = replicated["layers"]["attn"]
    attn["qkv"] = by_columns(repeat, attn["qkv"])
    if "qkv_bias" in attn:
        attn["qkv_bias"] = repeat(attn["qkv_bias"])
    return replicated
