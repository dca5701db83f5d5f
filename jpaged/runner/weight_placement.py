"""How the loaders' weights become the step's weights on the devices: each KV head repeated for more devices than
KV heads, the matrix products' layout (the CPU kernel's panels, or fused columns grouped per shard), and the
placement, which under tensor parallelism gives each device only its own part."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh

from jpaged.models.checkpoint import CheckpointedWeight
from jpaged.models.config import ModelConfig
from jpaged.models.fused_columns import fused_leaves, replicate_kv_heads
from jpaged.models.lazy_weights import LazyWeight
from jpaged.models.products import MatrixProducts
from jpaged.runner.tensor_parallel import (
    AXIS,
    param_shardings,
    place_restored,
    place_sharded,
    tensor_parallel_config,
)


@dataclass(frozen=True)
class WeightPlacement:
    products: MatrixProducts
    loaded_config: ModelConfig  # the weights' shapes as loaded
    kv_copies: int  # see tensor_parallel.kv_head_copies
    # Each weight's NamedSharding over the mesh as the step holds it, and before the products hold it
    # (QuantizedProducts.hold quantizes); None on one device.
    shardings: dict | None = None
    arranged_shardings: dict | None = None

    @classmethod
    def over(
        cls,
        mesh: Mesh,
        products: MatrixProducts,
        loaded_config: ModelConfig,
        kv_copies: int,
        params: dict,
        expert_parallel: bool = False,
    ) -> WeightPlacement:
        """The placement of `params` (the loaders') over `mesh`, split as the model run there splits them (the
        experts whole on their devices with `expert_parallel`)."""
        unsharded = cls(products, loaded_config, kv_copies)
        config = tensor_parallel_config(mesh.shape[AXIS], loaded_config)
        abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
        arranged = jax.eval_shape(unsharded.arrange, abstract)
        held = jax.eval_shape(products.hold, arranged)
        return cls(
            products,
            loaded_config,
            kv_copies,
            param_shardings(mesh, config, held, expert_parallel),
            param_shardings(mesh, config, arranged, expert_parallel),
        )

    def arrange(self, params: dict) -> dict:
        """The loaders' params with their columns where the step reads them (KV heads repeated, fused columns
        grouped per shard), not yet held as the products hold them."""
        return self.products.arrange(self._repeated(params))

    def layout(self, params: dict) -> dict:
        """The loaders' params as the step takes them."""
        return self.products.layout(self._repeated(params))

    def _repeated(self, params: dict) -> dict:
        if self.kv_copies > 1:
            return replicate_kv_heads(params, self.loaded_config, self.kv_copies)
        return params

    def to_device(self, weights: dict) -> dict:
        """Weights already in the step's layout on the device, or sharded over the mesh."""
        return jax.device_put(weights, self.shardings)

    def place(self, params: dict) -> dict:
        """The loaders' params on the device in the step's layout. Sharded, host arrays and lazy weights go to
        each device as its own part (tensor_parallel.place_sharded: a lazy weight reads just that part from its
        file; an orbax checkpoint's are restored into their shards, place_restored), then are held as the
        products hold them on each device's part (quantized on the mesh); device arrays (a trainer's) are laid
        out where they are."""
        leaves = jax.tree_util.tree_leaves(params)
        on_host = not any(isinstance(x, jax.Array) for x in leaves)
        if self.shardings is not None and on_host:
            columns = self._fused_columns(params)
            if all(isinstance(x, CheckpointedWeight) for x in leaves):
                placed = place_restored(params, self.arranged_shardings, columns)
            else:
                placed = place_sharded(params, self.arranged_shardings, columns)
            if jax.tree_util.tree_structure(self.shardings) == jax.tree_util.tree_structure(placed):
                return placed
            hold = jax.jit(self.products.hold, out_shardings=self.shardings, donate_argnums=0)
            return hold(placed)
        read = jax.tree_util.tree_map(lambda x: np.asarray(x) if isinstance(x, LazyWeight) else x, params)
        return self.to_device(self.layout(read))

    def column_sources(self, widths: dict[tuple[str, str], int]) -> dict[tuple[str, str], np.ndarray]:
        """For fused leaves (their path in a DecoderLayer -> their width as loaded), the loaders' column each of
        their step-layout columns comes from: the layout applied to the columns' indices."""
        indices: dict = {"layers": {}}
        for (parent, name), width in widths.items():
            indices["layers"].setdefault(parent, {})[name] = np.arange(width)
        laid_out = self.arrange(indices)["layers"]
        return {(parent, name): np.asarray(laid_out[parent][name]) for parent, name in widths}

    def _fused_columns(self, params: dict) -> dict[str, np.ndarray]:
        """column_sources of each fused leaf (by key path) whose columns the layout moves."""
        layers = params["layers"]
        widths = {(parent, name): layers[parent][name].shape[-1] for parent, name in fused_leaves(layers)}
        return {
            f"['layers']['{parent}']['{name}']": source
            for (parent, name), source in self.column_sources(widths).items()
            if not np.array_equal(source, np.arange(widths[parent, name]))  # moved (not whole experts)
        }
