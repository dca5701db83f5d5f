"""Tensor parallelism on one host: a mesh over `tensor_parallel_size` devices (axis "tp"), the weights sharded
from the models' logical axes Megatron-style (attention by heads, MLP gate/up by columns and down by rows,
embedding and LM head by vocabulary, norms replicated), the KV pool by KV heads, and the attention kernel under
`shard_map` on each device's own heads. Everything else is XLA's: it inserts the collectives (an all-reduce after
the attention output and the MLP down projections) and runs the sampler on the vocabulary-sharded logits
(logits_sharding). More devices than KV heads repeat each KV head (kv_head_copies), as vLLM does.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jpaged.models.config import ModelConfig
from jpaged.models.fused_columns import along_columns
from jpaged.models.llama import HEADS, MLP, QKV, VOCAB, abstract_params, partition_specs
from jpaged.models.moe import EXPERTS
from jpaged.models.products import is_whole_leaf

AXIS = "tp"
SHARDED_AXES = (VOCAB, QKV, HEADS, MLP)  # logical axes split over the mesh; the others are replicated
# (EXPERTS: under expert parallelism, the only one an expert stack is split along)


def check_tensor_parallel_size(size: int, config: ModelConfig) -> None:
    """Each device must hold whole heads: `size` divides the query heads, and divides the KV heads or is a
    multiple of them (each device then holds a copy of one: see kv_head_copies)."""
    if config.num_heads % size:
        raise ValueError(
            f"tensor_parallel_size ({size}) must divide the model's {config.num_heads} attention heads"
        )
    kv = config.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(
            f"tensor_parallel_size ({size}) must divide the model's {kv} KV heads or be a multiple of them"
        )


def kv_head_copies(size: int, config: ModelConfig) -> int:
    """How many copies of each KV head `size` devices hold between them: 1 while the devices split the KV heads,
    else size / KV heads (vLLM's replication: each device keeps the one its query heads read)."""
    return max(1, size // config.num_kv_heads)


def tensor_parallel_config(size: int, config: ModelConfig) -> ModelConfig:
    """The model as `size` devices run it: its KV heads repeated (kv_head_copies) when they are fewer than the
    devices, so that the pool and the attention split by KV heads like any other model."""
    copies = kv_head_copies(size, config)
    return config if copies == 1 else dataclasses.replace(config, num_kv_heads=config.num_kv_heads * copies)


def tensor_parallel_mesh(size: int, config: ModelConfig) -> Mesh:
    """The first `size` devices as one "tp" axis; refuses sizes that exceed them or split a head."""
    if size > jax.device_count():
        raise ValueError(
            f"tensor_parallel_size ({size}) exceeds the {jax.device_count()} devices this process has"
        )
    check_tensor_parallel_size(size, config)
    return Mesh(np.array(jax.devices()[:size]), (AXIS,))


def param_shardings(
    mesh: Mesh, config: ModelConfig, params: dict | None = None, expert_parallel: bool = False
) -> dict:
    """A NamedSharding for every weight of `params` (arrays or ShapeDtypeStructs; default the float model's state
    dict) as the model's logical axes split it; an axis the mesh does not divide is replicated. A mixture of
    experts' expert stacks are split as the dense MLP (each expert's MLP columns), or with `expert_parallel`
    by experts (each device holding whole experts: expert_parallel.py). A quantized matrix
    (models.products.WholeLeaf) has each of its arrays split as the matrix it stands for (a transposed one's the
    other way round): its codes with its rows and columns, its scales and biases with their groups and columns,
    a per-tensor or per-column scale whole along the axis it does not have."""
    size = mesh.shape[AXIS]

    def named(axes: tuple, leaf) -> NamedSharding:
        split = (EXPERTS,) if expert_parallel and EXPERTS in axes else SHARDED_AXES
        dims = zip(axes, leaf.shape, strict=True)
        return NamedSharding(
            mesh, P(*[AXIS if axis in split and dim % size == 0 else None for axis, dim in dims])
        )

    def sharding(spec: P, leaf):
        axes = tuple(spec)
        if not is_whole_leaf(leaf):
            return named(axes, leaf)
        if getattr(leaf, "transposed", False):
            axes = (*axes[:-2], axes[-1], axes[-2])
        return jax.tree_util.tree_map(functools.partial(named, axes), leaf)

    return jax.tree_util.tree_map(
        sharding,
        partition_specs(config),
        abstract_params(config) if params is None else params,
        is_leaf=lambda x: isinstance(x, P),
    )


def logits_sharding(mesh: Mesh, vocab_size: int) -> NamedSharding:
    """The logits [S, V] between the forward and the sampling programs: split by vocabulary like the LM head
    that makes them (replicated where the mesh does not divide it), so the sampler runs vocabulary-parallel
    and no device gathers the whole logits."""
    return NamedSharding(mesh, P(None, AXIS if vocab_size % mesh.shape[AXIS] == 0 else None))


def place_sharded(params: dict, shardings: dict, columns: dict) -> dict:
    """Host params (numpy) on the mesh, each device given only its part, cut from the host arrays: a weight that
    `columns` names (its path -> the host column each of the step's columns comes from, for the fused matrices
    whose KV heads are repeated and columns grouped per shard) is gathered column by column (a quantized one's
    arrays that run along its columns: fused_columns.along_columns), the rest sliced. No device ever holds a whole
    matrix, and a process builds only its own devices' parts."""

    def place_weight(path, weight, weight_shardings):
        source = columns.get(jax.tree_util.keystr(path))

        def place(leaf: np.ndarray, sharding: NamedSharding) -> jax.Array:
            picked = source if source is not None and along_columns(leaf, weight) else None
            shape = leaf.shape if picked is None else (*leaf.shape[:-1], len(picked))

            def part(index: tuple[slice, ...]) -> np.ndarray:
                if picked is None:
                    return leaf[index]
                return leaf[(*index[:-1], picked[index[-1]])]

            return jax.make_array_from_callback(shape, sharding, part)

        return jax.tree_util.tree_map(place, weight, weight_shardings)

    return jax.tree_util.tree_map_with_path(place_weight, params, shardings, is_leaf=is_whole_leaf)


def place_restored(params: dict, shardings: dict, columns: dict) -> dict:
    """Checkpointed params (models.checkpoint.CheckpointedWeight) on the mesh, each process reading only its own
    devices' parts from the checkpoint. A leaf that `columns` names (see place_sharded) is restored split along
    another axis, then regrouped on the devices: each picks the step's columns from its block and an all-to-all
    hands every device its own columns (no device holds a whole matrix, and XLA's all-gathers are avoided)."""
    from jpaged.models.checkpoint import restore_sharded

    mesh = next(iter(jax.tree_util.tree_leaves(shardings))).mesh
    size = mesh.shape[AXIS]

    def split_axis(leaf) -> int | None:
        return next((i for i, dim in enumerate(leaf.shape[:-1]) if dim % size == 0), None)

    def source_sharding(path, leaf, sharding: NamedSharding) -> NamedSharding:
        if jax.tree_util.keystr(path) not in columns:
            return sharding
        axis = split_axis(leaf)
        return NamedSharding(mesh, P(*(AXIS if i == axis else None for i in range(leaf.ndim))))

    restored = restore_sharded(params, jax.tree_util.tree_map_with_path(source_sharding, params, shardings))
    flat, treedef = jax.tree_util.tree_flatten_with_path(restored)
    del restored
    paths, leaves = [jax.tree_util.keystr(path) for path, _ in flat], [leaf for _, leaf in flat]
    del flat
    for i, (path, sharding) in enumerate(zip(paths, jax.tree_util.tree_leaves(shardings), strict=True)):
        if (source := columns.get(path)) is not None:  # the restored block is freed once regrouped
            leaves[i] = _regroup_columns(leaves[i], source, sharding, split_axis(leaves[i]))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _regroup_columns(
    leaf: jax.Array, source: np.ndarray, sharding: NamedSharding, axis: int | None
) -> jax.Array:
    """leaf[..., source] with `sharding` (its last axis split), from the stacked `leaf` split along `axis` (None:
    replicated). Split, it is regrouped a layer of each device's block at a time into the donated result, so
    besides the block and the result only one layer's columns are in flight (the whole block at once cost a
    block-sized copy more, bench_load.py)."""
    if axis is None:  # each device picks its own columns from its whole copy
        return jax.jit(lambda w: jnp.take(w, source, axis=-1), out_shardings=sharding)(leaf)
    mesh = sharding.mesh
    size = mesh.shape[AXIS]
    local_layers = leaf.shape[0] // size if axis == 0 else leaf.shape[0]

    def regroup_layer(out: jax.Array, block: jax.Array, j: jax.Array) -> jax.Array:
        picked = jnp.take(jax.lax.dynamic_index_in_dim(block, j, keepdims=True), source, axis=-1)
        moved = jax.lax.all_to_all(picked, AXIS, split_axis=picked.ndim - 1, concat_axis=axis, tiled=True)
        if axis == 0:  # device d's layer j is the stack's layer d * local_layers + j
            return out.at[jnp.arange(size) * local_layers + j].set(moved)
        return jax.lax.dynamic_update_index_in_dim(out, moved[0], j, 0)

    step = jax.jit(
        jax.shard_map(
            regroup_layer,
            mesh=mesh,
            in_specs=(sharding.spec, leaf.sharding.spec, P()),
            out_specs=sharding.spec,
        ),
        donate_argnums=0,
    )
    shape = (*leaf.shape[:-1], len(source))
    out = jax.jit(lambda: jnp.zeros(shape, leaf.dtype), out_shardings=sharding)()
    for j in range(local_layers):
        out = step(out, leaf, np.int32(j))
    return out


def kv_sharding(mesh: Mesh) -> NamedSharding:
    """The pool [L, N, B, Hk, Dh] split by KV heads: each device holds its own heads' pages."""
    return NamedSharding(mesh, P(None, None, None, AXIS, None))


def shard_attention(attention: Callable, mesh: Mesh) -> Callable:
    """`attention` (the stacked-cache signature) run by each device on its query heads and their KV heads; sinks
    (one a query head) split by heads like q, the other options the same on every device."""
    heads, pages, replicated = P(None, AXIS, None), P(None, None, None, AXIS, None), P()

    def sharded(
        q, k_cache, v_cache, layer, kv_lens, block_tables, query_start, num_seqs, sinks=None, **options
    ):
        args = (q, k_cache, v_cache, layer, kv_lens, block_tables, query_start, num_seqs)
        in_specs = (heads, pages, pages) + (replicated,) * 5
        if sinks is not None:  # one a query head: each device takes its own heads'
            args, in_specs = (*args, sinks), (*in_specs, P(AXIS))

        def local(*local_args):
            if sinks is None:
                return attention(*local_args, **options)
            return attention(*local_args[:-1], sinks=local_args[-1], **options)

        return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=heads, check_vma=False)(*args)

    return sharded
