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
    transposed, per-layer ones stacked), each part read only over the rows and columns asked for."""

    recipe: LeafRecipe
    slicer: Slicer
    num_layers: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @classmethod
    def of(cls, recipe: LeafRecipe, slicer: Slicer, num_layers: int, dtype) -> FusedWeight:
        shapes = [tuple(slicer(name.format(i=0)).get_shape()) for name in recipe.names]
        shapes = [shape[::-1] for shape in shapes] if recipe.transposed else shapes
        shape = (*shapes[0][:-1], sum(shape[-1] for shape in shapes))
        return cls(
            recipe, slicer, num_layers, (num_layers, *shape) if recipe.per_layer else shape, np.dtype(dtype)
        )

    def __getitem__(self, index) -> np.ndarray:
        if not self.recipe.per_layer:
            return self._read(None, index)
        return np.stack([self._read(layer, index[1:]) for layer in range(self.num_layers)[index[0]]])

    def _read(self, layer: int | None, index) -> np.ndarray:
        *lead, last = index
        columns = _columns(last, self.shape[-1])
        parts, offset = [], 0  # (where in the result, its columns read from one part)
        for name in self.recipe.names:
            tensor = self.slicer(name.format(i=layer))
            size = tensor.get_shape()[0 if self.recipe.transposed else -1]
            wanted = (columns >= offset) & (columns < offset + size)
            if wanted.any():

                def read(cols: slice, tensor=tensor) -> np.ndarray:
                    if self.recipe.transposed:  # ours [in, out] is transformers' [out, in]
                        return tensor[cols, lead[0]].T
                    return tensor[(*lead, cols)]

                parts.append((wanted, _read_columns(read, columns[wanted] - offset)))
            offset += size
        result = np.empty((*parts[0][1].shape[:-1], len(columns)), self.dtype)
        for wanted, values in parts:
            result[..., wanted] = values
        return result
