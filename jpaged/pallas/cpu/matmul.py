"""The model's matrix products on the CPU through a C++ kernel (matmul.cc), called as an XLA FFI custom call.

A weight matrix w [K, N] ([in, out]) is stored as panels of 16 columns, `pack(w)` [P, K, 16] (P = ceil(N / 16),
the last panel zero-padded), each panel contiguous, so a step streams it from memory once while a block of results
(8 rows x 32 columns with AVX-512, 6 x 16 with AVX2, 32 x 32 in AMX tiles for bfloat16) sits in registers. Where
the kernel multiplies bfloat16 with vdpbf16ps or the AMX tiles, a panel's rows k and k + 1 are stored interleaved,
as those instructions take them (`pairs`, `kernel_panels`). A layer's stack [L, K, N] packs to [L, P, K, 16] and
the kernel reads layer `layer` in place. Only the first `rows` rows of x are computed (the rest of the output is
zero): a decode step of 6 sequences padded to 16 tokens does 6 rows of work.

An MLP's gate and up matrices, [K, 2F] side by side, pack for the gated form (`pack_gated`: gate and up panels
alternating), whose product `gated_matmul` is silu(x @ gate) * (x @ up) [M, F]: the activation computed on the sums
as they leave the registers, not by XLA in passes of its own over a [M, 2F] product (scripts/KERNELS.md).

XLA's own CPU dots of a decode step (8-64 rows) reach a fraction of the memory bandwidth and pay for padded rows;
`python scripts/bench_matmul.py` compares the two. A row's result does not depend on the other rows: every output is
summed over K in the same order whatever the number of rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.pallas.cpu import library
from jpaged.rounding import cdiv

PANEL = 16
_TARGET = "jpaged_matmul"
_GATED_TARGET = "jpaged_matmul_gated"
KERNEL = library.Kernel("matmul.cc", {_TARGET: "JpagedMatmul", _GATED_TARGET: "JpagedMatmulGated"})


def supports(dtype) -> bool:
    """Whether the kernels take weights of `dtype` here (the machine builds them; this one builds on first use)."""
    return jnp.dtype(dtype) in library.SUPPORTED_DTYPES and library.compiles()


def on_host_or_jitted(*static_argnames: str):
    """A layout `f(xp, w, ...)`, xp numpy or jax.numpy, run with numpy where `w` is a host array, so that laying
    out a model's weights compiles nothing (a program for each weight's shape was half a second of every warm
    start, each too quick to compile for the persistent cache to keep it), jitted on jax arrays and in traces."""

    def wrap(layout):
        jitted = jax.jit(functools.partial(layout, jnp), static_argnames=static_argnames)

        @functools.wraps(layout)
        def run(w, *args, **kwargs):
            if isinstance(w, np.ndarray):
                return layout(np, w, *args, **kwargs)
            return jitted(w, *args, **kwargs)

        return run

    return wrap


def pairs(dtype, k: int) -> bool:
    """Whether the kernel built here reads panels of `dtype` and K `k` paired: bfloat16 of an even K where it
    multiplies with vdpbf16ps or the AMX tiles, which take rows k and k + 1 of a column side by side (laid out so
    once, at load, rather than paired again by every product)."""
    return jnp.dtype(dtype) == jnp.bfloat16 and k % 2 == 0 and library.pairs_bfloat16_panels()


@on_host_or_jitted("paired")
def pack(xp, w: jax.Array, paired: bool = False) -> jax.Array:
    """w [..., K, N] -> panels [..., ceil(N / 16), K, 16]; `paired` (K even) with each panel's rows k and k + 1
    interleaved, [K / 2, 16, 2] in memory."""
    *lead, k, n = w.shape
    if n % PANEL:  # numpy's pad copies even where it adds nothing
        w = xp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, -n % PANEL)])
    pair, d = 2 if paired else 1, len(lead)
    split = w.reshape(*lead, k // pair, pair, -1, PANEL)  # [.., pair of rows, its row, panel, column]
    return xp.transpose(split, (*range(d), d + 2, d, d + 3, d + 1)).reshape(*lead, -1, k, PANEL)


def gated_packs(width: int) -> bool:
    """Whether a gate|up matrix `width` (2F) columns wide takes the gated form: F a multiple of 16."""
    return width % (2 * PANEL) == 0


@on_host_or_jitted("paired")
def pack_gated(xp, w: jax.Array, paired: bool = False) -> jax.Array:
    """gate|up w [..., K, 2F] -> panels [..., 2F / 16, K, 16] in the order gate 0, up 0, gate 1, up 1, ...;
    `paired` as `pack`."""
    if not gated_packs(w.shape[-1]):
        raise ValueError(
            f"the gated form needs gate and up widths that are multiples of {PANEL}, got {w.shape}"
        )
    *lead, k, width = w.shape
    pair, d = 2 if paired else 1, len(lead)
    # [.., pair of rows, its row, gate or up, its panel, column]
    halves = w.reshape(*lead, k // pair, pair, 2, width // (2 * PANEL), PANEL)
    order = (*range(d), d + 3, d + 2, d, d + 4, d + 1)
    return xp.transpose(halves, order).reshape(*lead, width // PANEL, k, PANEL)  # one copy


def kernel_panels(w: jax.Array, *, gated: bool = False) -> jax.Array:
    """w [..., K, N] as the kernel built here reads it: `pack` (or `pack_gated`), paired where it `pairs`."""
    return (pack_gated if gated else pack)(w, paired=pairs(w.dtype, w.shape[-2]))


def columns(panels: jax.Array, ids: jax.Array) -> jax.Array:
    """w[:, ids].T [len(ids), K] read from w's `kernel_panels` [P, K, 16] (a tied embedding's rows from the LM
    head's)."""
    num_panels, k, _ = panels.shape
    pair = 2 if pairs(panels.dtype, k) else 1
    rows = panels.reshape(num_panels, k // pair, PANEL, pair)[ids // PANEL, :, ids % PANEL, :]
    return rows.reshape(*ids.shape, k)


def matmul(
    x: jax.Array,
    panels: jax.Array,
    n: int,
    *,
    layer: jax.Array | int = 0,
    rows: jax.Array | int | None = None,
    out_dtype=None,
) -> jax.Array:
    """x [M, K] @ w [K, n] from w's panels ([P, K, 16], or [L, P, K, 16] with `layer` picking one), summed in
    float32 and returned as `out_dtype` (x's, or float32); rows past `rows` (default M) come back zero."""
    panels = _checked(x, panels, n, cdiv(n, PANEL), "product")
    return ffi_product(_TARGET, x, (panels,), n, layer=layer, rows=rows, out_dtype=out_dtype)


def gated_matmul(
    x: jax.Array,
    panels: jax.Array,
    n: int,
    *,
    layer: jax.Array | int = 0,
    rows: jax.Array | int | None = None,
) -> jax.Array:
    """silu(x @ gate) * (x @ up) [M, n] in x's dtype, from `pack_gated` panels of gate|up [K, 2n] (or a stack of
    them with `layer`), rounded as the unfused product's output and its activation would be; rows past `rows` come
    back zero."""
    if n % PANEL:
        raise ValueError(f"the gated form needs n a multiple of {PANEL}, got {n}")
    panels = _checked(x, panels, n, 2 * n // PANEL, "activation")
    return ffi_product(_GATED_TARGET, x, (panels,), n, layer=layer, rows=rows)


def _checked(x: jax.Array, panels: jax.Array, n: int, num_panels: int, what: str) -> jax.Array:
    """The panels as a stack [L, P, K, 16], once x, n and their shapes and dtypes agree (else ValueError)."""
    library.require(KERNEL)
    if panels.ndim == 3:
        panels = panels[None]
    if x.ndim != 2 or panels.ndim != 4 or panels.shape[2] != x.shape[1] or panels.shape[1] != num_panels:
        raise ValueError(f"x {x.shape} and panels {panels.shape} do not make an [M, {n}] {what}")
    if x.dtype != panels.dtype or jnp.dtype(x.dtype) not in library.SUPPORTED_DTYPES:
        raise ValueError(f"x and panels must both be float32 or bfloat16, got {x.dtype} and {panels.dtype}")
    return panels


def ffi_product(
    target: str, x: jax.Array, operands: tuple, n: int, *, layer, rows, out_dtype=None
) -> jax.Array:
    """The CPU products' custom call `target`, (x, *operands, layer, rows) -> [M, n] as `out_dtype` (x's, or
    float32); rows past `rows` (default M) come back zero."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if out_dtype not in (jnp.dtype(x.dtype), jnp.dtype(jnp.float32)):
        raise ValueError(f"out_dtype must be x's dtype or float32, got {out_dtype}")
    rows = x.shape[0] if rows is None else rows
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), out_dtype))
    return call(
        x, *operands, jnp.asarray(layer, jnp.int32).reshape(1), jnp.asarray(rows, jnp.int32).reshape(1)
    )
