"""Weights read from their files only where a device needs them. Under tensor parallelism each device's part of each
weight is cut straight from memory-mapped safetensors (an HF directory's, or the GGUF conversion cache's) with
`get_slice`, so a host reads its own devices' shards and never holds the whole model.

A lazy weight stands in for a leaf of the loaders' state dict: it has the leaf's shape and dtype, and indexing it
with basic slices, the last one possibly an integer array of columns (the fused columns a shard gathers), reads
just that. np.asarray reads all of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from jpaged.models.params import LeafRecipe

# A tensor's name -> its safetensors slice handle (indexable with slices; get_shape).
Slicer = Callable[[str], Any]


class LazyWeight:
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[tuple(slice(None) for _ in self.shape)]
        return whole if dtype is None else whole.astype(dtype, copy=False)

    def __getitem__(self, index) -> np.ndarray:
        raise NotImplementedError


def _columns(index, size: int) -> np.ndarray:
    """The last axis's part of an index as column numbers."""
    return np.arange(size)[index] if isinstance(index, slice) else np.asarray(index)


def _read_columns(read: Callable[[slice], np.ndarray], columns: np.ndarray) -> np.ndarray:
    """Columns picked from the one contiguous range that covers them (get_slice reads ranges only)."""
    low = int(columns.min())
    return read(slice(low, int(columns.max()) + 1))[..., columns - low]


@dataclass(frozen=True, eq=False)
class StoredWeight(LazyWeight):
    """An array stored whole under `name` (the GGUF conversion cache keeps the state dict's own leaves)."""

    tensor: Any  # its safetensors slice handle
    shape: tuple[int, ...]
    dtype: np.dtype

    def __getitem__(self, index) -> np.ndarray:
        *lead, last = index
        columns = _columns(last, self.shape[-1])
        return _read_columns(lambda cols: self.tensor[(*lead, cols)], columns).astype(self.dtype, copy=False)


@dataclass(frozen=True, eq=False)
class FusedWeight(LazyWeight):
    """A leaf made of transformers tensors as its recipe says (joined along the last axis, linear weights
    transposed, interleaved gate/up columns read as gate | up, per-expert ones stacked on a leading experts axis, per-layer ones on a leading layers axis before
    it), each part read only over the layers, experts, rows and columns asked for: a device that holds some of
    the experts reads only theirs."""

    recipe: LeafRecipe
    slicer: Slicer
    num_layers: int
    shape: tuple[int, ...]
    dtype: np.dtype
    num_experts: int = 0

    @classmethod
    def of(
        cls, recipe: LeafRecipe, slicer: Slicer, num_layers: int, dtype, num_experts: int = 0
    ) -> FusedWeight:
        shapes = [tuple(slicer(name.format(i=0, j=0)).get_shape()) for name in recipe.names]
        shapes = [shape[::-1] for shape in shapes] if recipe.transposed else shapes
        shape = (*shapes[0][:-1], sum(shape[-1] for shape in shapes))
        stacked = (num_layers,) * recipe.per_layer + (num_experts,) * recipe.per_expert
        return cls(recipe, slicer, num_layers, (*stacked, *shape), np.dtype(dtype), num_experts)

    def __getitem__(self, index) -> np.ndarray:
        stacked = (("i", self.num_layers),) * self.recipe.per_layer
        stacked += (("j", self.num_experts),) * self.recipe.per_expert
        return self._stacked({}, stacked, tuple(index))

    def _stacked(self, at: dict[str, int], stacked: tuple, index: tuple) -> np.ndarray:
        """The part `index` of the leaf's stack over the `stacked` axes (a name's key, how many), the tensors at
        `at` (layer "i", expert "j") already chosen."""
        if not stacked:
            return self._read(at, index)
        (key, count), *rest = stacked
        return np.stack(
            [self._stacked({**at, key: n}, tuple(rest), index[1:]) for n in range(count)[index[0]]]
        )

    def _read(self, at: dict[str, int], index) -> np.ndarray:
        *lead, last = index
        columns = _columns(last, self.shape[-1])
        parts, offset = [], 0  # (where in the result, its columns read from one part)
        for name in self.recipe.names:
            tensor = self.slicer(name.format(i=at.get("i"), j=at.get("j")))
            size = tensor.get_shape()[0 if self.recipe.transposed else -1]
            wanted = (columns >= offset) & (columns < offset + size)
            if wanted.any():

                def read(cols: slice, tensor=tensor) -> np.ndarray:
                    if self.recipe.transposed:  # ours [in, out] is transformers' [out, in]
                        return tensor[cols, lead[0]].T
                    return tensor[(*lead, cols)]

                local = columns[wanted] - offset
                if self.recipe.interleaved:  # our gate | up is the tensor's alternate columns
                    half = size // 2
                    local = np.where(local < half, 2 * local, 2 * (local - half) + 1)
                parts.append((wanted, _read_columns(read, local)))
            offset += size
        result = np.empty((*parts[0][1].shape[:-1], len(columns)), self.dtype)
        for wanted, values in parts:
            result[..., wanted] = values
        return result
