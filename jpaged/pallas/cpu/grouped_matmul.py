"""Products with group-quantized matrices on the CPU through a C++ kernel (grouped_matmul.cc), as an XLA FFI call.

A group-quantized matrix w [K, N] is codes [K, N] (4- or 8-bit integers), and a scale and a bias for each group of G
consecutive k of a column, [K / G, N]: w[k, n] = scale[k // G, n] * codes[k, n] + bias[k // G, n] (GGUF's Q4_1 as
it is, Q4_0 with bias -8 scale, Q8_0 with bias 0). `pack` lays it out as the dense kernel's panels of 16 columns
(matmul.py), 4-bit codes two a byte (rows 2i and 2i + 1 of a column, low nibble first), so a step reads half a byte
a weight. The kernel dequantises each work item's panels into a buffer in x's dtype and multiplies them as the dense
kernel does: `matmul(x, ...)` equals x @ dequantised w in x's dtype (summed in float32) for any number of rows.
The kernel is built once per form (`kernel`: the codes', scales', x's and output's dtypes), each form's FFI targets
named after it, so that a model waits for the build of its own forms only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.pallas.cpu import library
from jpaged.pallas.cpu.matmul import PANEL, ffi_product, on_host_or_jitted, pack_gated
from jpaged.pallas.cpu.matmul import pack as pack_panels
from jpaged.rounding import cdiv

CODE_BITS = (4, 8)


@functools.cache
def kernel(bits: int, codes_dtype, scale_dtype, x_dtype, out_dtype=None) -> library.Kernel:
    """The form of the kernel that multiplies x of `x_dtype` by `pack`ed codes of `bits` and scales of these dtypes
    into `out_dtype` (x's, or float32): its targets end in the bits and the four dtypes' names."""
    names = tuple(jnp.dtype(d).name for d in (codes_dtype, scale_dtype, x_dtype, out_dtype or x_dtype))
    if (
        bits not in CODE_BITS
        or (bits == 4 and names[0] != "uint8")
        or any(name not in library.C_TYPES for name in names)
        or names[3] not in (names[2], "float32")
    ):
        raise ValueError(f"the grouped kernel has no form for {bits}-bit codes, scale, x, out of {names}")
    suffix = "_".join((f"q{bits}", *names))
    return library.Kernel(
        "grouped_matmul.cc",
        {
            f"jpaged_grouped_matmul_{suffix}": "JpagedGroupedMatmul",
            f"jpaged_grouped_matmul_gated_{suffix}": "JpagedGroupedMatmulGated",
        },
        (
            f"-DJPAGED_GROUPED_BITS={bits}",
            *(
                f"-DJPAGED_GROUPED_{part}={library.C_TYPES[name]}"
                for part, name in zip(("CODE", "SCALE", "X", "OUT"), names, strict=True)
            ),
        ),
    )


@on_host_or_jitted("bits", "gated")
def pack(
    xp, codes: jax.Array, scale: jax.Array, bias: jax.Array, *, bits: int, gated: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """codes [..., K, N], scale and bias [..., K / G, N] -> their panels, codes [..., P, K / 2 or K, 16] and scale
    and bias [..., P, K / G, 16]; `gated` for a gate|up matrix in the gated form's panel order (`pack_gated`)."""
    if bits not in CODE_BITS:
        raise ValueError(f"codes must be {CODE_BITS} bits, got {bits}")
    panels = pack_gated if gated else pack_panels
    if bits == 4:  # rows paired before the panels are made: the columns' order leaves the rows' alone
        low, high = codes[..., 0::2, :], codes[..., 1::2, :]
        codes = (low.astype(np.uint8) & 15) | (high.astype(np.uint8) << 4)
    return panels(codes), panels(scale), panels(bias)


def reads(matrix) -> bool:
    """Whether the kernel multiplies by this GroupedMatrix (models/grouped.py): integer codes of CODE_BITS bits
    (float8 codes, a block-scaled FP8 checkpoint's, are dequantised the XLA way)."""
    integer = jnp.issubdtype(matrix.codes.dtype, jnp.integer)
    return integer and matrix.bits in CODE_BITS and (matrix.bits == 8 or matrix.group_size % 2 == 0)


def columns(
    panels: tuple[jax.Array, jax.Array, jax.Array], ids: jax.Array, *, bits: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Columns `ids` of w read back from its `pack`ed panels (a tied embedding's rows from the LM head's): codes
    [len(ids), K] (unpacked) and scale and bias [len(ids), K / G], for the caller to dequantise."""
    codes, scale, bias = (p[ids // PANEL, :, ids % PANEL] for p in panels)
    if bits == 4:
        codes = jnp.stack([codes & 15, codes >> 4], axis=-1).reshape(codes.shape[0], -1)
    return codes, scale, bias


def matmul(
    x: jax.Array,
    panels: tuple[jax.Array, jax.Array, jax.Array],
    n: int,
    *,
    layer: jax.Array | int = 0,
    rows: jax.Array | int | None = None,
    out_dtype=None,
) -> jax.Array:
    """x [M, K] @ w [K, n] from w's `pack`ed panels (of one matrix, or a stack of them with `layer` picking one),
    summed in float32 and returned as `out_dtype` (x's, or float32); rows past `rows` come back zero."""
    panels = _checked(x, panels, cdiv(n, PANEL))
    target = _target(x, panels, out_dtype, gated=False)
    return ffi_product(target, x, panels, n, layer=layer, rows=rows, out_dtype=out_dtype)


def gated_matmul(
    x: jax.Array,
    panels: tuple[jax.Array, jax.Array, jax.Array],
    n: int,
    *,
    layer: jax.Array | int = 0,
    rows: jax.Array | int | None = None,
) -> jax.Array:
    """silu(x @ gate) * (x @ up) [M, n] in x's dtype from the gated `pack` of gate|up [K, 2n], as the dense
    kernel's gated form computes it."""
    if n % PANEL:
        raise ValueError(f"the gated form needs n a multiple of {PANEL}, got {n}")
    panels = _checked(x, panels, 2 * n // PANEL)
    return ffi_product(_target(x, panels, None, gated=True), x, panels, n, layer=layer, rows=rows)


def _target(x: jax.Array, panels: tuple[jax.Array, ...], out_dtype, *, gated: bool) -> str:
    """The FFI target of the form for these operands, built (or loaded) first."""
    bits = 8 if panels[0].shape[2] == x.shape[1] else 4  # 4-bit codes two a byte: K / 2 rows
    form = kernel(bits, panels[0].dtype, panels[1].dtype, x.dtype, out_dtype)
    library.require(form)
    plain, gated_target = form.targets
    return gated_target if gated else plain


def _checked(x: jax.Array, panels, num_panels: int) -> tuple[jax.Array, ...]:
    """The panels as stacks [L, P, ., 16], once they and x agree (else ValueError)."""
    panels = tuple(p[None] if p.ndim == 3 else p for p in panels)
    codes, scale, bias = panels
    k = x.shape[-1] if x.ndim == 2 else -1
    if codes.ndim != 4 or codes.shape[1] != num_panels or codes.shape[2] not in (k, k // 2):
        raise ValueError(f"x {x.shape} and codes {codes.shape} do not make a product of {num_panels} panels")
    if scale.shape != bias.shape or scale.shape[:2] != codes.shape[:2] or k % scale.shape[2]:
        raise ValueError(f"scale {scale.shape} and bias {bias.shape} do not group codes {codes.shape}")
    if jnp.dtype(x.dtype) not in library.SUPPORTED_DTYPES:
        raise ValueError(f"x must be float32 or bfloat16, got {x.dtype}")
    return panels
