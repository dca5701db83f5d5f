"""A step's host inputs (batch, sampling tensors, prompt targets) as one int32 buffer: one host-to-device transfer
per step instead of one per array, sliced back into the arrays on the device.

Every input is 32-bit (int32, uint32, float32) or bool; each travels as its 32-bit words. The `PackedLayout` (the
inputs' tree, and each array's shape, dtype and offset) is static: it is part of what a step is compiled for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class PackedLayout:
    treedef: Any  # jax.tree_util.PyTreeDef of the inputs (None fields are empty subtrees)
    arrays: tuple[tuple[tuple[int, ...], str, int], ...]  # each leaf's (shape, dtype name, offset in words)


def pack(inputs) -> tuple[np.ndarray, PackedLayout]:
    """The inputs' leaves (numpy) as one int32 buffer, and the layout that unpacks it."""
    leaves, treedef = jax.tree_util.tree_flatten(inputs)
    words, arrays, offset = [], [], 0
    for leaf in leaves:
        leaf = np.asarray(leaf)
        if leaf.dtype == np.bool_:
            flat = leaf.astype(np.int32).ravel()
        elif leaf.dtype.itemsize == 4:
            flat = np.ascontiguousarray(leaf).view(np.int32).ravel()
        else:
            raise ValueError(f"step inputs must be 32-bit or bool, got {leaf.dtype}")
        arrays.append((leaf.shape, leaf.dtype.name, offset))
        words.append(flat)
        offset += flat.size
    buffer = np.concatenate(words) if words else np.zeros(0, np.int32)
    return buffer, PackedLayout(treedef, tuple(arrays))


def unpack(buffer: jax.Array, layout: PackedLayout):
    """Device side: the inputs `pack` packed, as slices of `buffer` (static offsets, so no gather)."""
    leaves = []
    for shape, dtype, offset in layout.arrays:
        size = int(np.prod(shape))
        words = buffer[offset : offset + size].reshape(shape)
        if dtype == "bool":
            leaves.append(words != 0)
        elif dtype == "int32":
            leaves.append(words)
        else:
            leaves.append(jax.lax.bitcast_convert_type(words, jnp.dtype(dtype)))
    return jax.tree_util.tree_unflatten(layout.treedef, leaves)
