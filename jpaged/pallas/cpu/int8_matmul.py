"""int8 products on the CPU through a C++ kernel (int8_matmul.cc), as an XLA FFI call: the W8A8 form of
`--quantization int8` (models/quantized.py). The kernel quantises x's rows to int8 as `quantize_rows` does, sums
them with an int8 matrix exactly in int32, and scales the sums back as `rescaled` does, in x's dtype: equal to the
XLA form (quantize_rows, an int8 dot, rescaled) to the bit, whatever the rows.

`pack` lays a matrix [..., K, N] out as panels of 16 columns with four consecutive k of a column side by side,
[..., P, K' / 4, 16, 4] (K' = K rounded up to 64 with zero rows): the layout the AMX tiles' B operand takes as it is,
so the kernel reads a step's weights straight from the stack, a byte a weight. Its column scales [..., 1, N] are
packed as the dense kernel's panels ([..., P, 1, 16], matmul.pack). `gated` packs a gate|up matrix in the order of
the dense kernel's gated form (matmul.pack_gated), whose output is silu(x @ gate) * (x @ up).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jpaged.pallas.cpu import library
from jpaged.pallas.cpu.matmul import PANEL, ffi_product, pack_gated
from jpaged.pallas.cpu.matmul import pack as pack_panels
from jpaged.rounding import cdiv

_TARGET = "jpaged_int8_matmul"
_GATED_TARGET = "jpaged_int8_matmul_gated"
KERNEL = library.Kernel(
    "int8_matmul.cc", {_TARGET: "JpagedInt8Matmul", _GATED_TARGET: "JpagedInt8MatmulGated"}
)
TILE_K = 64  # k a tile step: the kernel's K is a multiple of it
GROUP = 4  # k side by side in a panel's column


def _padded_k(k: int) -> int:
    return cdiv(k, TILE_K) * TILE_K


@functools.partial(jax.jit, static_argnames=("gated",))
def pack(values: jax.Array, scale: jax.Array, *, gated: bool = False) -> tuple[jax.Array, jax.Array]:
    """int8 w [..., K, N] and its column scales [..., 1, N] -> panels [..., ceil(N / 16), K' / 4, 16, 4] and
    [..., ceil(N / 16), 1, 16]."""
    *lead, k, n = values.shape
    values = jnp.pad(values, [(0, 0)] * len(lead) + [(0, _padded_k(k) - k), (0, -n % PANEL)])
    grouped = values.reshape(*lead, _padded_k(k) // GROUP, GROUP, -1, PANEL)  # [.., K'/4, 4, P, 16]
    panels = jnp.moveaxis(grouped, (-4, -3, -2, -1), (-3, -1, -4, -2))
    if not gated:
        return panels, pack_panels(scale)
    num_panels = panels.shape[-4]
    halves = panels.reshape(*lead, 2, num_panels // 2, *panels.shape[-3:])  # gate's panels, then up's
    return jnp.swapaxes(halves, len(lead), len(lead) + 1).reshape(panels.shape), pack_gated(scale)


def matmul(
    x: jax.Array,
    panels: tuple[jax.Array, jax.Array],
    n: int,
    *,
    layer: jax.Array | int = 0,
    rows: jax.Array | int | None = None,
    out_dtype=None,
) -> jax.Array:
    """x [M, K] (float32 or bfloat16) @ w [K, n], W8A8, from w's `pack`ed panels and scales (of one matrix, or a
    stack of them with `layer` picking one), in `out_dtype` (x's, or float32); rows past `rows` come back zero."""
    return ffi_product(
        _TARGET, x, _checked(x, panels, cdiv(n, PANEL)), n, layer=layer, rows=rows, out_dtype=out_dtype
    )


def gated_matmul(
    x: jax.Array,
    panels: tuple[jax.Array, jax.Array],
    n: int,
    *,
    layer: jax.Array | int = 0,
    rows: jax.Array | int | None = None,
) -> jax.Array:
    """silu(x @ gate) * (x @ up) [M, n] in x's dtype from the gated `pack` of gate|up [K, 2n], each product's
    output rounded to x's dtype as the unfused product's is."""
    if n % PANEL:
        raise ValueError(f"the gated form needs n a multiple of {PANEL}, got {n}")
    return ffi_product(_GATED_TARGET, x, _checked(x, panels, 2 * n // PANEL), n, layer=layer, rows=rows)


def _checked(x: jax.Array, panels, num_panels: int) -> tuple[jax.Array, jax.Array]:
    library.require(KERNEL)
    values, scale = (p[None] if p.ndim == nd else p for p, nd in zip(panels, (4, 3), strict=True))
    if jnp.dtype(x.dtype) not in library.SUPPORTED_DTYPES or values.dtype != jnp.int8:
        raise ValueError(
            f"x must be float32 or bfloat16 and the panels int8, got {x.dtype} and {values.dtype}"
        )
    k = _padded_k(x.shape[-1])
    if x.ndim != 2 or values.ndim != 5 or values.shape[2] * GROUP != k or values.shape[1] != num_panels:
        raise ValueError(
            f"x {x.shape} and panels {values.shape} do not make a product of {num_panels} panels"
        )
    if scale.shape != (*values.shape[:2], 1, PANEL) or scale.dtype != jnp.float32:
        raise ValueError(f"scale {scale.shape} {scale.dtype} does not go with panels {values.shape}")
    return values, scale
