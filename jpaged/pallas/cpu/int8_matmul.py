"""int8 products on the CPU through a C++ kernel (int8_matmul.cc), as an XLA FFI call: the W8A8 form of
`--quantization int8` (models/quantized.py), int8 activations (quantised per token) times an int8 matrix, summed
exactly in int32.

`pack` lays a matrix [..., K, N] out as panels of 16 columns with four consecutive k of a column side by side,
[..., P, K' / 4, 16, 4] (K' = K rounded up to 64 with zero rows): the layout the AMX tiles' B operand takes as it is,
so the kernel reads a step's weights straight from the stack, a byte a weight. `matmul` pads x's K alike (zeros add
nothing) and returns the int32 sums, equal to XLA's int8 dot to the bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jpaged.pallas.cpu import library
from jpaged.pallas.cpu.matmul import PANEL
from jpaged.rounding import cdiv

_TARGET = "jpaged_int8_matmul"
TILE_K = 64  # k a tile step: the kernel's K is a multiple of it
GROUP = 4  # k side by side in a panel's column


def _padded_k(k: int) -> int:
    return cdiv(k, TILE_K) * TILE_K


@jax.jit
def pack(values: jax.Array) -> jax.Array:
    """int8 w [..., K, N] -> panels [..., ceil(N / 16), K' / 4, 16, 4]."""
    *lead, k, n = values.shape
    values = jnp.pad(values, [(0, 0)] * len(lead) + [(0, _padded_k(k) - k), (0, -n % PANEL)])
    grouped = values.reshape(*lead, _padded_k(k) // GROUP, GROUP, -1, PANEL)  # [.., K'/4, 4, P, 16]
    return jnp.moveaxis(grouped, (-4, -3, -2, -1), (-3, -1, -4, -2))


def matmul(
    x: jax.Array,
    panels: jax.Array,
    n: int,
    *,
    layer: jax.Array | int = 0,
    rows: jax.Array | int | None = None,
) -> jax.Array:
    """int8 x [M, K] @ w [K, n] from w's panels ([P, K' / 4, 16, 4], or a stack of them with `layer` picking one):
    int32 sums [M, n]; rows past `rows` (default M) come back zero."""
    library.require()
    panels = panels[None] if panels.ndim == 4 else panels
    if x.dtype != jnp.int8 or panels.dtype != jnp.int8:
        raise ValueError(f"x and panels must be int8, got {x.dtype} and {panels.dtype}")
    k = _padded_k(x.shape[-1])
    if x.ndim != 2 or panels.ndim != 5 or panels.shape[2] * GROUP != k or panels.shape[1] != cdiv(n, PANEL):
        raise ValueError(f"x {x.shape} and panels {panels.shape} do not make an [M, {n}] product")
    x = jnp.pad(x, [(0, 0), (0, k - x.shape[1])])
    rows = x.shape[0] if rows is None else rows
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.int32))
    return call(x, panels, jnp.asarray(layer, jnp.int32).reshape(1), jnp.asarray(rows, jnp.int32).reshape(1))
