"""Products with group-quantized matrices on NVIDIA GPUs: a Pallas (Triton) kernel that reads the codes as stored and
widens them in registers (W4A16, W8A16, and float8 codes with block scales as W8A16).

w [K, N] is codes (4-bit, two a byte; 8-bit integers; or float8 e4m3) and a scale and a bias for each group of G
consecutive k of a column, [K / G, N]: w[k, n] = scale[k // G, n] * codes[k, n] + bias[k // G, n] (models/grouped.py).
Each program computes an [bm, bn] tile of x @ w, walking K in steps of `bk` inputs that lie within one group, so a
step reads one row of scales and biases: it loads the step's codes, widens them to float32, applies the group's
scale and bias, rounds to x's dtype and feeds the tensor cores, summing in float32.

`pack` lays 4-bit codes out for that walk: within each step of bk inputs, the low nibbles of its bk / 2 bytes are the
first half of the step's inputs and the high nibbles the second half, so the two halves are two dots over contiguous
slices of x (no interleaving in registers). Imports only jax: the lowering tests run it under a bare jax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

CODE_BITS = (4, 8)
_MAX_STEP = 128  # inputs a step of the K walk
_TILE_ROWS = 16  # the tensor cores' smallest M


def k_step(group: int, bits: int) -> int:
    """Inputs a step of the K walk: the largest power of two <= 128 that divides the group (so a step lies in one
    group), at least 32 for 4-bit codes (each half a dot of 16 or more) and 16 for 8-bit."""
    step = _MAX_STEP
    while step > 1 and group % step:
        step //= 2
    if step < (32 if bits == 4 else 16):
        raise ValueError(
            f"group size {group} gives K steps of {step}: the GPU kernel takes groups of 16/32 or more"
        )
    return step


@functools.partial(jax.jit, static_argnames=("bits", "group"))
def pack(codes: jax.Array, *, bits: int, group: int) -> jax.Array:
    """codes [..., K, N] (one a byte) as the kernel reads them: 8-bit as they are, 4-bit [..., K / 2, N], each
    step's first half of inputs in the low nibbles and its second half in the high ones."""
    if bits not in CODE_BITS:
        raise ValueError(f"codes must be {CODE_BITS} bits, got {bits}")
    if bits == 8:
        return codes
    step = k_step(group, bits)
    *lead, k, n = codes.shape
    halves = codes.astype(jnp.uint8).reshape(*lead, k // step, 2, step // 2, n)
    packed = (halves[..., 0, :, :] & 15) | (halves[..., 1, :, :] << 4)
    return packed.reshape(*lead, k // 2, n)


def _tile_columns(n: int) -> int:
    for bn in (128, 64, 32, 16):
        if n % bn == 0:
            return bn
    raise ValueError(f"the GPU kernel takes N a multiple of 16, got {n}")


def _kernel(x_ref, codes_ref, scale_ref, bias_ref, out_ref, *, bm, bn, step, group, bits, steps):
    rows, cols = pl.ds(pl.program_id(0) * bm, bm), pl.ds(pl.program_id(1) * bn, bn)
    dtype = x_ref.dtype

    def widened(codes, scale, bias):
        return (codes.astype(jnp.float32) * scale + bias).astype(dtype)

    def body(s, acc):
        g = pl.ds((s * step) // group, 1)
        scale, bias = scale_ref[g, cols].astype(jnp.float32), bias_ref[g, cols].astype(jnp.float32)
        if bits == 4:
            half = step // 2
            packed = codes_ref[pl.ds(s * half, half), cols]
            low, high = widened(packed & 15, scale, bias), widened(packed >> 4, scale, bias)
            first, second = x_ref[rows, pl.ds(s * step, half)], x_ref[rows, pl.ds(s * step + half, half)]
            acc += jnp.dot(first, low, preferred_element_type=jnp.float32)
            return acc + jnp.dot(second, high, preferred_element_type=jnp.float32)
        w = widened(codes_ref[pl.ds(s * step, step), cols], scale, bias)
        return acc + jnp.dot(x_ref[rows, pl.ds(s * step, step)], w, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
    out_ref[rows, cols] = acc.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("bits", "out_dtype", "interpret"))
def matmul(
    x: jax.Array,
    codes: jax.Array,
    scale: jax.Array,
    bias: jax.Array,
    *,
    bits: int,
    out_dtype=None,
    interpret: bool = False,
) -> jax.Array:
    """x [M, K] @ w [K, N] for w's `pack`ed codes and its scale and bias [K / G, N]; summed in float32, returned in
    `out_dtype` (x's by default)."""
    m, k = x.shape
    groups, n = scale.shape
    group = k // groups
    if bits not in CODE_BITS or k % groups or codes.shape != (k * bits // 8, n) or bias.shape != scale.shape:
        raise ValueError(
            f"x {x.shape}, codes {codes.shape}, scale {scale.shape} do not make a {bits}-bit product"
        )
    step, bm, bn = k_step(group, bits), _TILE_ROWS, _tile_columns(n)
    padded = -(-m // bm) * bm
    x = jnp.pad(x, ((0, padded - m), (0, 0)))
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))  # noqa: E731
    out = pl.pallas_call(
        functools.partial(_kernel, bm=bm, bn=bn, step=step, group=group, bits=bits, steps=k // step),
        grid=(padded // bm, n // bn),
        in_specs=[whole(a.shape) for a in (x, codes, scale, bias)],
        out_specs=whole((padded, n)),
        out_shape=jax.ShapeDtypeStruct((padded, n), out_dtype or x.dtype),
        compiler_params=_triton_params(),
        interpret=interpret,
        name="grouped_matmul",
    )(x, codes, scale, bias)
    return out[:m]


def _triton_params():
    """Imported where used: a jax without the Triton backend still imports the engine (and its Mosaic GPU step)."""
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=4, num_stages=2)
