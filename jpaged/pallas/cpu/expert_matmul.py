"""A mixture of experts' products on the CPU through a C++ kernel (expert_matmul.cc), called as an XLA FFI custom
call: the rows of x sorted by expert (models/experts.py), `group_sizes[e]` of them expert e's, each run times its
expert's matrix. The experts' stacks [L, E, K, N] pack as the dense kernel's panels (matmul.py's `kernel_panels`,
gated for gate|up) with the experts axis kept, [L, E, P, K, 16], and the kernel reads layer `layer`'s experts
in place: each expert's panels stream from memory once for its rows, an expert no row takes is not read at all
(XLA's CPU ragged_dot computes every expert on every row, scripts/bench_moe.py). A row's result depends only on
its expert, in the summation order of the dense kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jpaged.pallas.cpu import library
from jpaged.pallas.cpu.matmul import PANEL
from jpaged.rounding import cdiv

_TARGET = "jpaged_expert_matmul"
_GATED_TARGET = "jpaged_expert_matmul_gated"
KERNEL = library.Kernel(
    "expert_matmul.cc", {_TARGET: "JpagedExpertMatmul", _GATED_TARGET: "JpagedExpertMatmulGated"}
)


def matmul(
    x: jax.Array, panels: jax.Array, group_sizes: jax.Array, n: int, *, layer: jax.Array | int
) -> jax.Array:
    """Each expert's run of x [M, K] times its matrix [K, n] from the panels [L, E, P, K, 16] of layer `layer`,
    summed in float32, in x's dtype; rows past the groups come back zero."""
    return _call(_TARGET, x, panels, group_sizes, n, cdiv(n, PANEL), layer)


def gated_matmul(
    x: jax.Array, panels: jax.Array, group_sizes: jax.Array, n: int, *, layer: jax.Array | int
) -> jax.Array:
    """silu(x @ gate) * (x @ up) [M, n] of each expert's run, from the gated form's `kernel_panels` of its gate|up [K, 2n]."""
    if n % PANEL:
        raise ValueError(f"the gated form needs n a multiple of {PANEL}, got {n}")
    return _call(_GATED_TARGET, x, panels, group_sizes, n, 2 * n // PANEL, layer)


def _call(target: str, x, panels, group_sizes, n: int, num_panels: int, layer) -> jax.Array:
    library.require(KERNEL)
    if x.ndim != 2 or panels.ndim != 5 or panels.shape[3] != x.shape[1] or panels.shape[2] != num_panels:
        raise ValueError(f"x {x.shape} and expert panels {panels.shape} do not make an [M, {n}] product")
    if group_sizes.shape != (panels.shape[1],):
        raise ValueError(f"group_sizes {group_sizes.shape} must name each of the {panels.shape[1]} experts")
    if x.dtype != panels.dtype or jnp.dtype(x.dtype) not in library.SUPPORTED_DTYPES:
        raise ValueError(f"x and panels must both be float32 or bfloat16, got {x.dtype} and {panels.dtype}")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), x.dtype))
    return call(x, panels, group_sizes.astype(jnp.int32), jnp.asarray(layer, jnp.int32).reshape(1))
