"""Ragged paged attention: the XLA reference and the Pallas kernels behind one call.

Every implementation answers `ragged_paged_attention(q, k_pages, v_pages, kv_lens, block_tables, query_start,
num_seqs, *, sm_scale, sliding_window=None, logits_soft_cap=None, interpret=False)` (see reference.py for shapes).
The model calls the *stacked* form, `fn(q, k_cache, v_cache, layer, ...)` over a cache `[L, N, B, Hk, D]`, which
`get_attention_fn` builds for the chosen implementation.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax

from jpaged.pallas.reference import paged_attention_stacked, ragged_paged_attention_reference

ATTENTION_IMPLS = ("auto", "reference", "pallas")

logger = logging.getLogger(__name__)

__all__ = [
    "ATTENTION_IMPLS",
    "get_attention_fn",
    "ragged_paged_attention_reference",
    "resolve_attention_impl",
]


def resolve_attention_impl(impl: str, backend: str | None = None) -> str:
    """`auto` means the Pallas kernel on GPU/TPU and the XLA reference on CPU (interpret mode is for tests)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    return "reference" if (backend or jax.default_backend()) == "cpu" else "pallas"


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
    if resolve_attention_impl(impl, backend) == "reference":
        return paged_attention_stacked
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
