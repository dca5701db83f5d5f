"""The engine's LoRA slots on the device: the fixed-shape stacks the step reads, in the layout its deltas take
(models/lora.py's XlaLoRA, or the C++ kernel's panels on a CPU: lora_panels.py), and the one compiled program that
writes an adapter into a slot in place. An adapter's B columns follow its base matrix's
(KV heads repeated, fused columns grouped per tensor-parallel shard), and under tensor parallelism A and B are split
as the base matrix is: B by columns where the base matrix is split by columns (qkv, gate_up), A by rows where it is
split by rows (o, down), so each device computes its part of the delta beside its part of the product."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jpaged.config import EngineConfig
from jpaged.models.config import ModelConfig
from jpaged.models.lora import XlaLoRA
from jpaged.models.products import LAYER_MATRICES, MatrixProducts
from jpaged.runner.lora_panels import PanelLoRA
from jpaged.runner.tensor_parallel import AXIS
from jpaged.runner.weight_layout import PanelProducts
from jpaged.runner.weight_placement import WeightPlacement

# Which of a LoRA pair splits with its base matrix under tensor parallelism, and along which of its axes (of A
# [L, S, in, W] or B [L, S, W, out]).
SPLIT = {"qkv": ("b", 3), "gate_up": ("b", 3), "o": ("a", 2), "down": ("a", 2)}
# How XLA computes the deltas (models/lora.py's LORA_METHODS) where the C++ kernel does not, by
# scripts/bench_lora.py.
LORA_METHODS_BY_BACKEND = {"cpu": "dense", "gpu": "dense", "tpu": "dense"}


def lora_layout(
    products: MatrixProducts, shapes: dict[str, tuple[int, int, int]], max_loras: int, backend: str
) -> XlaLoRA | PanelLoRA:
    """The C++ kernel's panels beside its panels of the weights (a CPU), else XLA's stacks."""
    if isinstance(products, PanelProducts):
        return PanelLoRA(max_loras, tuple((name, w, out) for name, (_, w, out) in shapes.items()))
    return XlaLoRA(LORA_METHODS_BY_BACKEND.get(backend, "dense"))


def lora_stacks(
    config: EngineConfig,
    loaded_config: ModelConfig,
    shapes: dict[str, tuple[int, int, int]],
    dtype,
    mesh: Mesh | None,
    weights: WeightPlacement,
    layout: XlaLoRA | PanelLoRA,
) -> LoRAStacks:
    """The engine's adapter slots for this model (`shapes`: models/lora_weights.lora_shapes), in `layout`, B's
    columns where the step's layout puts the base matrix's."""
    columns = {}
    if mesh is not None:  # KV heads repeated, fused columns grouped per shard: as the base matrices'
        paths = {name: LAYER_MATRICES[name] for name in ("qkv", "gate_up") if name in shapes}
        sources = weights.column_sources({path: shapes[name][2] for name, path in paths.items()})
        columns = {name: sources[path] for name, path in paths.items()}
    return LoRAStacks(shapes, loaded_config.num_layers, config.max_loras, dtype, columns, mesh, layout)


class LoRAStacks:
    """`max_loras` slots of every layer matrix's A and B in `layout`; slot s (1..S) is row s - 1, all zeros until
    an adapter is written there."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, int, int]],
        num_layers: int,
        max_loras: int,
        dtype,
        columns: dict[str, np.ndarray],
        mesh: Mesh | None,
        layout: XlaLoRA | PanelLoRA,
    ) -> None:
        """`shapes`: each matrix's (in, W, out) as the loaders' weights have it (models/lora_weights.lora_shapes);
        `columns`: for a matrix whose columns the step's layout moves, the loaders' column each of the step's comes
        from."""
        self.columns = columns
        self.dtype = dtype
        self.max_loras = max_loras
        self.layout = layout
        # One slot's arrays as `write` takes them: A [L, in, W] and B [L, W, out] (out: the step's columns).
        self.slot_shapes = {
            name: ((num_layers, d_in, width), (num_layers, width, len(columns.get(name, range(out)))))
            for name, (d_in, width, out) in shapes.items()
        }
        self.shapes = {
            name: layout.shapes(a[1], a[2], b[2], num_layers, max_loras)
            for name, (a, b) in self.slot_shapes.items()
        }
        self.shardings = None
        if mesh is not None:
            self.shardings = {
                name: {
                    part: _sharding(mesh, name, part, shape) for part, shape in zip("ab", pair, strict=True)
                }
                for name, pair in self.shapes.items()
            }
        self.stacks = self._zeros()
        self._adapter_shardings = None
        if mesh is not None:
            replicated = NamedSharding(mesh, P())
            self._adapter_shardings = jax.tree_util.tree_map(lambda _: replicated, self._host_zeros())
        self._write = None

    def compile_writer(self, compile_fn: Callable) -> None:
        """Compile the slot writer once (`compile_fn(jitted, args, name)`: the runner's executable cache), so that
        no adapter load compiles."""
        adapter = jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            self._host_zeros(),
            self._adapter_shardings or jax.tree_util.tree_map(lambda _: None, self._host_zeros()),
        )
        stacks = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.stacks
        )
        jitted = jax.jit(self.layout.write, donate_argnums=0, out_shardings=self.shardings)
        self._write = compile_fn(jitted, (stacks, np.int32(0), adapter), "lora_write_slot")

    def _zeros(self) -> dict:
        def zeros(shape, sharding):
            return jax.jit(lambda: jnp.zeros(shape, self.dtype), out_shardings=sharding)()

        return {
            name: {
                part: zeros(shape, None if self.shardings is None else self.shardings[name][part])
                for part, shape in zip("ab", pair, strict=True)
            }
            for name, pair in self.shapes.items()
        }

    def _host_zeros(self) -> dict:
        """One slot's arrays (an adapter as `write` takes it, arranged), zero."""
        return {
            name: {part: np.zeros(shape, np.float32) for part, shape in zip("ab", pair, strict=True)}
            for name, pair in self.slot_shapes.items()
        }

    def write(self, slot: int, weights: dict) -> None:
        """Slot `slot` (1..max_loras) set to an adapter's weights (models/lora_weights: name -> {"a": [L, in, W],
        "b": [L, W, out]} in the loaders' column order, every matrix the stacks hold). In place; compiles
        nothing."""
        if self._write is None:
            raise RuntimeError("write() needs compile_writer() first")
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"slot must be in 1..{self.max_loras}, got {slot}")
        adapter = {}
        for name, pair in weights.items():
            source = self.columns.get(name)
            b = np.asarray(pair["b"], np.float32)
            adapter[name] = {
                "a": np.asarray(pair["a"], np.float32),
                "b": b if source is None else b[..., source],
            }
        if self._adapter_shardings is not None:
            adapter = jax.device_put(adapter, self._adapter_shardings)
        self.stacks = self._write(self.stacks, np.int32(slot - 1), adapter)


def _sharding(mesh: Mesh, name: str, part: str, shape: tuple[int, ...]) -> NamedSharding:
    split_part, axis = SPLIT[name]
    dims = [None] * len(shape)
    if part == split_part and shape[axis] % mesh.shape[AXIS] == 0:
        dims[axis] = AXIS
    return NamedSharding(mesh, P(*dims))
