"""Ragged paged attention: the XLA reference and the Pallas kernels behind one call.

Every implementation answers `ragged_paged_attention(q, k_pages, v_pages, kv_lens, block_tables, query_start,
num_seqs, *, sm_scale, sliding_window=None, logits_soft_cap=None, interpret=False)` (see reference.py for shapes).
Implementations: `reference` (XLA), `pallas` (GPU/TPU kernels; interpret mode on CPU, for tests) and `cpu` (a C++
kernel called through XLA's FFI, built on first use; see cpu_attention.py). The model calls the *stacked* form,
`fn(q, k_cache, v_cache, layer, ...)` over a cache `[L, N, B, Hk, D]`, which `get_attention_fn` builds for the
chosen implementation.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax

from jpaged.pallas import cpu_attention, cpu_library
from jpaged.pallas.reference import paged_attention_stacked, ragged_paged_attention_reference

ATTENTION_IMPLS = ("auto", "reference", "pallas", "cpu")

logger = logging.getLogger(__name__)

__all__ = [
    "ATTENTION_IMPLS",
    "get_attention_fn",
    "ragged_paged_attention_reference",
    "resolve_attention_impl",
]


def resolve_attention_impl(impl: str, *, head_dim: int, dtype, backend: str | None = None) -> str:
    """The implementation `impl` means here. `auto`: the Pallas kernel on GPU/TPU; on CPU the C++ kernel where it
    builds and takes the cache's dtype and head size, else the XLA reference (with a warning saying why)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    backend = backend or jax.default_backend()
    if impl not in ("auto", "cpu"):
        return impl
    if backend != "cpu":
        if impl == "cpu":
            raise ValueError(f"attention_impl='cpu' runs on the CPU backend only, not {backend}")
        return "pallas"
    try:
        cpu_attention.check_layout(head_dim, dtype)
        if not cpu_library.available():
            raise ValueError("the CPU attention kernel could not be built (see the warning above)")
    except ValueError as err:
        if impl == "cpu":
            raise
        logger.warning("%s; attention_impl='auto' takes the XLA reference", err)
        return "reference"
    return "cpu"


def _pallas_kernel(backend: str) -> Callable:
    """The stacked-cache kernel: it reads the layer inside the kernel, so no layer of the pool is copied."""
    if backend == "tpu":
        from jpaged.pallas.ragged_paged_attention_tpu import ragged_paged_attention_stacked
    else:
        from jpaged.pallas.ragged_paged_attention import ragged_paged_attention_stacked
    return ragged_paged_attention_stacked


def get_attention_fn(
    impl: str = "auto", *, num_kv_heads: int, block_size: int, head_dim: int, dtype
) -> Callable:
    """The stacked-cache attention callable for `impl` on the current backend and this cache layout."""
    backend = jax.default_backend()
    impl = resolve_attention_impl(impl, head_dim=head_dim, dtype=dtype, backend=backend)
    if impl == "reference":
        return paged_attention_stacked
    if impl == "cpu":
        return cpu_attention.ragged_paged_attention_stacked
    if backend == "tpu":
        from jpaged.pallas.ragged_paged_attention_tpu import check_tpu_layout

        try:
            check_tpu_layout(num_kv_heads, block_size, head_dim, dtype)
        except ValueError as err:
            if impl == "pallas":
                raise
            logger.warning("TPU kernel cannot lay out this cache (%s); using the XLA reference", err)
            return paged_attention_stacked
    return functools.partial(_pallas_kernel(backend), interpret=backend == "cpu")
