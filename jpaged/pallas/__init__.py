"""Ragged paged attention: the XLA reference and the kernels behind one call.

`ragged_paged_attention(q, k_pages, v_pages, kv_lens, block_tables, query_start, num_seqs, *, sm_scale,
sliding_window=None, logits_soft_cap=None, k_scale=1.0, v_scale=1.0, sinks=None, interpret=False, impl="auto")`
is the entry point: the same contract on every backend (shapes in reference.py), dispatched by backend and
`impl`. Implementations: `reference` (XLA), `pallas` (on a GPU the Mosaic GPU kernel, mosaic_gpu.py, or the Triton
kernel, gpu.py, as `gpu_kernel_for` picks; on a TPU the TPU kernel, tpu.py; the Triton kernel in interpret mode on
CPU, for tests), `mosaic_gpu` and `triton` (that GPU kernel, whatever the device; interpret mode on CPU) and `cpu`
(C++ kernels called through XLA's FFI, built on first use; cpu/). The
model calls the *stacked* form,
`fn(q, k_cache, v_cache, layer, ...)` over a cache `[L, N, B, Hk, D]`, which `get_attention_fn` builds for the
chosen implementation; common.py holds what the kernels share.

KV pages hold q's dtype, or float8_e4m3fn (`--kv-cache-dtype fp8`) under float32 or bfloat16 queries. `k_scale` and
`v_scale` (default 1.0) multiply what the K and V pages hold, whatever their dtype: a page element `x` reads as
`float(x) * k_scale`. Each is a positive Python float or a float32 scalar array (shape () or (1,)), possibly traced,
such as `k_scales[layer]` inside the scan over layers: one compiled program serves every value. The kernels fold
the K scale into the scores' scale and the V scale into the output, never multiplying page elements.

`sliding_window` is None (no window), a positive Python int, or an int32 scalar array (shape () or (1,)), possibly
traced, such as `windows[layer]` inside the model's scan over layers: one compiled program serves every value, and
a value <= 0 means no window (Gemma's global layers). Only a None window is free of the window's mask.

`sinks` (gpt-oss) is None or a float32 array [Hq], possibly traced (`sinks[layer]`): a logit s_h a query head that
joins each row's softmax denominator and has no value, p_j = exp(x_j - m) / (exp(s_h - m) + sum_i exp(x_i - m)),
m = max(s_h, max_i x_i), over the row's (scaled, capped, masked) scores x. It is neither scaled nor capped, a -inf
sink is none, and under tensor parallelism it is split by heads like q. None leaves every kernel as it was.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax

from jpaged.config import ATTENTION_IMPLS
from jpaged.pallas import mosaic_gpu_fit
from jpaged.pallas.common import over_pages
from jpaged.pallas.cpu import attention as cpu_attention
from jpaged.pallas.cpu import library as cpu_library
from jpaged.pallas.reference import paged_attention_stacked, ragged_paged_attention_reference

logger = logging.getLogger(__name__)

__all__ = [
    "get_attention_fn",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "resolve_attention_impl",
]


def resolve_attention_impl(impl: str, *, head_dim: int, dtype, backend: str | None = None) -> str:
    """The implementation `impl` means here. `auto`: the Pallas kernel on GPU/TPU; on CPU the C++ kernel where it
    builds and takes the cache's dtype and head size, else the XLA reference (with a warning saying why)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    backend = backend or jax.default_backend()
    if impl in ("mosaic_gpu", "triton") and backend not in ("gpu", "cpu"):
        raise ValueError(
            f"attention_impl={impl!r} is a GPU kernel (interpret mode on CPU), not one for {backend}"
        )
    if impl not in ("auto", "cpu"):
        return impl
    if backend != "cpu":
        if impl == "cpu":
            raise ValueError(f"attention_impl='cpu' runs on the CPU backend only, not {backend}")
        return "pallas"
    try:
        cpu_attention.check_layout(head_dim, dtype)
        if not cpu_library.compiles():
            raise ValueError("the CPU attention kernel could not be built (see the warning above)")
    except ValueError as err:
        if impl == "cpu":
            raise
        logger.warning("%s; attention_impl='auto' takes the XLA reference", err)
        return "reference"
    return "cpu"


def gpu_compute_capability() -> str | None:
    """The first GPU's compute capability ("9.0" on Hopper), None where jax names none."""
    return getattr(jax.devices()[0], "compute_capability", None)


def gpu_kernel_for(
    compute_capability: str | None,
    *,
    num_q_heads: int | None,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype,
    kv_dtype=None,
) -> tuple[str, str]:
    """`pallas` on a GPU: ("mosaic_gpu" | "triton", why). Mosaic GPU on Hopper (compute capability 9.x: wgmma) and
    datacenter Blackwell (10.x: tcgen05) where its tiles fit the cache's layout; Triton before Hopper, on consumer
    Blackwell (12.x has no tcgen05) and for layouts the tiles do not fit."""
    arch = mosaic_gpu_fit.arch_for(compute_capability)
    if arch is None:
        return "triton", (
            "the Mosaic GPU kernel multiplies with Hopper's wgmma or datacenter Blackwell's tcgen05, which compute "
            f"capability {compute_capability} lacks"
        )
    try:
        mosaic_gpu_fit.check_layout(
            num_q_heads or num_kv_heads, num_kv_heads, block_size, head_dim, dtype, kv_dtype, arch
        )
    except ValueError as err:
        return "triton", str(err)
    return "mosaic_gpu", f"compute capability {compute_capability}: {arch}'s products"


def _pallas_kernel(impl: str) -> Callable:
    """The stacked-cache kernel: it reads the layer inside the kernel, so no layer of the pool is copied. Each
    module is imported only when chosen: a jax without the Triton backend still builds the Mosaic GPU step."""
    if impl == "tpu":
        from jpaged.pallas.tpu import ragged_paged_attention_stacked
    elif impl == "mosaic_gpu":
        from jpaged.pallas.mosaic_gpu import ragged_paged_attention_stacked
    else:
        from jpaged.pallas.gpu import ragged_paged_attention_stacked
    return ragged_paged_attention_stacked


def get_attention_fn(
    impl: str = "auto",
    *,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype,
    interpret: bool = False,
    num_q_heads: int | None = None,
    kv_dtype=None,
    compute_capability: str | None = None,
) -> Callable:
    """The stacked-cache attention callable for `impl` on the current backend and this cache layout; `interpret`
    runs a Pallas kernel in interpret mode (it always does on CPU). `kv_dtype` is the pages' (default `dtype`);
    `compute_capability` names the GPU the step is built for (default: the first device's)."""
    backend = jax.default_backend()
    impl = resolve_attention_impl(impl, head_dim=head_dim, dtype=dtype, backend=backend)
    if impl == "reference":
        return paged_attention_stacked
    if impl == "cpu":
        return cpu_attention.ragged_paged_attention_stacked
    options = dict(interpret=interpret or backend == "cpu")
    if backend == "gpu" and impl in ("pallas", "mosaic_gpu"):
        capability = compute_capability or gpu_compute_capability()
        if impl == "pallas":
            impl, why = gpu_kernel_for(
                capability,
                num_q_heads=num_q_heads,
                num_kv_heads=num_kv_heads,
                block_size=block_size,
                head_dim=head_dim,
                dtype=dtype,
                kv_dtype=kv_dtype,
            )
            kernel_name = "Mosaic GPU" if impl == "mosaic_gpu" else "Triton"
            logger.info("GPU attention: the %s kernel (%s)", kernel_name, why)
        if impl == "mosaic_gpu":
            options["arch"] = mosaic_gpu_fit.arch_for(capability)
            if options["arch"] is None:
                raise ValueError(
                    f"attention_impl='mosaic_gpu' needs Hopper or datacenter Blackwell, not {capability}"
                )
    if backend == "tpu":
        from jpaged.pallas.tpu import check_tpu_layout

        try:
            check_tpu_layout(num_kv_heads, block_size, head_dim, dtype)
        except ValueError as err:
            if impl == "pallas":
                raise
            logger.warning("TPU kernel cannot lay out this cache (%s); using the XLA reference", err)
            return paged_attention_stacked
    kernel = "tpu" if backend == "tpu" else impl
    return functools.partial(_pallas_kernel(kernel), **options)


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
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
    impl: str = "auto",
) -> jax.Array:
    """Attention of `q` [T, Hq, D] over pages `[N, B, Hk, D]` with `impl` on this backend; returns [T, Hq, D]."""
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be [N, B, Hk, D], got shape {k_pages.shape}")
    _, block_size, num_kv_heads, head_dim = k_pages.shape
    stacked = get_attention_fn(
        impl,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        head_dim=head_dim,
        dtype=k_pages.dtype,
        interpret=interpret,
    )
    return over_pages(stacked)(
        q,
        k_pages,
        v_pages,
        kv_lens,
        block_tables,
        query_start,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        sinks=sinks,
    )
