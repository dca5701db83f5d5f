"""Ragged paged attention on the CPU through a small C++ kernel (paged_attention.cc), called as an XLA FFI
custom call. Same contract as reference.py.

Pallas has no CPU backend, and in XLA the attention of a decode step gathers and transposes every page before its
dots: well over the time of just reading the KV data (README's bench_decode_step table). The kernel reads each page once, in place.

It is built on first use (library.py), once per form (`kernel`: the queries' dtype, and whether the pages are
float8); where the kernels cannot be built, `auto` falls back to the XLA reference.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.pallas.common import (
    FP8_PAGES,
    check_stacked_inputs,
    over_pages,
    scale_operand,
    sinks_operand,
    window_operand,
)
from jpaged.pallas.cpu import huge_pages, library


@functools.cache
def kernel(q_dtype, fp8_pages: bool = False) -> library.Kernel:
    """The form of the kernel for queries of `q_dtype` over pages of that dtype, or of float8_e4m3fn bytes."""
    name = jnp.dtype(q_dtype).name
    if jnp.dtype(q_dtype) not in library.SUPPORTED_DTYPES:
        raise ValueError(f"the CPU attention kernel takes float32 or bfloat16 queries, not {name}")
    pages = "float8_e4m3fn" if fp8_pages else name
    return library.Kernel(
        "paged_attention.cc",
        {f"jpaged_paged_attention_{name}_{pages}": "JpagedPagedAttention"},
        (f"-DJPAGED_ATTENTION_Q={library.C_TYPES[name]}", f"-DJPAGED_ATTENTION_FP8={int(fp8_pages)}"),
    )


def uninitialized(shape: tuple[int, ...], dtype) -> jax.Array:
    """An array of `shape` that nothing has written: a KV pool for this kernel, which never reads a slot no sequence
    owns. Zero-filling the default 4 GiB pool is seconds of a CPU start-up (README); untouched, its pages are
    mapped in as blocks are first written."""
    library.require(library.COMMON)
    return jax.jit(jax.ffi.ffi_call(library.UNINITIALIZED, jax.ShapeDtypeStruct(shape, dtype)))()


MAP_CHUNK = 4 << 20  # bytes of a layer's blocks mapped in at a time


@dataclasses.dataclass(frozen=True)
class PoolSpan:
    """Where one CPU buffer of a pool [L, N, B, Hk, D] lies: read off the array while it is alive, so that a mapper
    in another thread needs no array (a step donates the pool's arrays; the memory stays the pool's)."""

    address: int
    layer_bytes: int
    layers: int
    num_blocks: int


def pool_spans(kv_cache) -> list[PoolSpan]:
    """The spans of every CPU buffer of an `uninitialized` pool."""
    return [
        PoolSpan(buffer.unsafe_buffer_pointer(), buffer.nbytes // buffer.shape[0], *buffer.shape[:2])
        for buffer in huge_pages.cpu_buffers(kv_cache)
    ]


def map_in_first_blocks(
    spans: list[PoolSpan], count: int, before_chunk: Callable[[], object] | None = None
) -> int:
    """Map in the memory of blocks [0, count) of every layer of a pool's `spans`, as writes would, without writing;
    returns the bytes mapped in (0 where the OS cannot). `before_chunk` is called before each chunk (a pause).

    Each page of such a pool is otherwise mapped in when a step first writes it: a page fault inside the step's KV
    write, which the step's other threads wait on, and in a VM the host's first touch of that memory too
    (scripts/KERNELS.md: ~10% of a fresh engine's first batches). Blocks are handed out from the lowest free one
    (core/block_pool.py), so the first `count` are the ones a start-up's batches write, and they are mapped in
    lowest first across every layer (MAP_CHUNK at a time): mapped in beside an engine (runner/kv_pool_mapper.py),
    the blocks its first requests write are the first mapped in."""
    done = 0
    for span in spans:
        block_bytes, end = span.layer_bytes // span.num_blocks, min(count, span.num_blocks)
        chunk = max(1, MAP_CHUNK // block_bytes)
        for first in range(0, end, chunk):
            length = block_bytes * (min(first + chunk, end) - first)
            for layer in range(span.layers):
                if before_chunk is not None:
                    before_chunk()
                if not huge_pages.populate(
                    span.address + layer * span.layer_bytes + first * block_bytes, length
                ):
                    return done
                done += length
    return done


def check_layout(head_dim: int, dtype) -> None:
    """The kernel works in float32 on eight-float vectors, on pages of `dtype`; raises ValueError where it cannot."""
    if jnp.dtype(dtype) not in (*library.SUPPORTED_DTYPES, FP8_PAGES):
        raise ValueError(f"the CPU kernel takes float32, bfloat16 or float8_e4m3fn, not {jnp.dtype(dtype)}")
    if head_dim % 8:
        raise ValueError(f"the CPU kernel needs a head_dim that is a multiple of 8, got {head_dim}")


def ragged_paged_attention_stacked(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | jax.Array | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float | jax.Array = 1.0,
    v_scale: float | jax.Array = 1.0,
    sinks: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
    """The kernel over one layer of a stacked cache `[L, N, B, Hk, D]` (contract in jpaged.pallas). float8_e4m3fn
    pages are passed as they are (XLA's CPU FFI hands them over as F8E4M3FN buffers), widened in the kernel; the
    AVX-512-BF16 paths are bfloat16 pages' only, so fp8 pages take the float32 path. Sinks are an operand only where
    there are some (the kernel's last, optional one): without, the call is what it was before sinks."""
    del interpret  # same signature as the Pallas kernels
    pages = [k_cache, v_cache]
    if k_cache.dtype == jnp.uint16 and q.dtype == jnp.bfloat16:  # a bfloat16 pool stored as its 16-bit words
        pages = [jax.ShapeDtypeStruct(x.shape, q.dtype) for x in pages]
    if k_cache.dtype == jnp.uint8:  # an e4m3 pool stored as its bytes
        pages = [jax.ShapeDtypeStruct(x.shape, jnp.float8_e4m3fn) for x in pages]
    check_stacked_inputs(
        q,
        *pages,
        kv_lens,
        block_tables,
        query_start,
        num_seqs,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        sinks=sinks,
    )
    check_layout(q.shape[-1], q.dtype)
    form = kernel(q.dtype, fp8_pages=pages[0].dtype == FP8_PAGES)
    library.require(form)
    (target,) = form.targets
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(
        q,
        k_cache,
        v_cache,
        jnp.asarray(layer, jnp.int32).reshape(1),
        kv_lens,
        block_tables,
        query_start,
        num_seqs,
        window_operand(sliding_window),
        scale_operand(k_scale),
        scale_operand(v_scale),
        *(() if sinks is None else (sinks_operand(sinks),)),
        sm_scale=np.float32(sm_scale),
        soft_cap=np.float32(logits_soft_cap or 0.0),
    )


ragged_paged_attention = over_pages(ragged_paged_attention_stacked)
