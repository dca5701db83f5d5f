"""What the attention kernels share: the input checks of their contract, the window, KV scales and sinks as
operands, the tile-to-sequence search, and the pages form of a stacked-cache kernel."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

NEG_INF = -1e30  # finite "minus infinity": a fully masked row stays NaN-free
SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# The quantised KV pages (`--kv-cache-dtype fp8`): stored = e4m3(k / k_scale), read as float(stored) * k_scale.
FP8_PAGES = jnp.dtype(jnp.float8_e4m3fn)
FP8_QUERY_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def check_inputs(
    q,
    k_pages,
    v_pages,
    kv_lens,
    block_tables,
    query_start,
    num_seqs,
    sliding_window,
    soft_cap,
    k_scale=1.0,
    v_scale=1.0,
    sinks=None,
):
    """Static checks shared by the kernels; raises ValueError naming the field."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {q.shape}")
    if k_pages.ndim not in (4, 5) or k_pages.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"k_pages must be [(L,) N, B, Hk, D] with D={q.shape[-1]}, got shape {k_pages.shape}"
        )
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} must equal k_pages shape {k_pages.shape}")
    check_dtypes(q, k_pages, v_pages)
    if q.shape[1] % k_pages.shape[-2]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k_pages heads ({k_pages.shape[-2]})")
    num_seq_slots = kv_lens.shape[0] if kv_lens.ndim == 1 else -1
    for name, array, shape in (
        ("kv_lens", kv_lens, (num_seq_slots,)),
        ("block_tables", block_tables, (num_seq_slots, block_tables.shape[-1])),
        ("query_start", query_start, (num_seq_slots + 1,)),
        ("num_seqs", num_seqs, (1,)),
    ):
        if array.shape != shape or array.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32{list(shape)}, got {array.dtype}{list(array.shape)}")
    check_window(sliding_window)
    check_scale("k_scale", k_scale)
    check_scale("v_scale", v_scale)
    check_sinks(sinks, q.shape[1])
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"logits_soft_cap must be positive, got {soft_cap}")


def check_stacked_inputs(
    q,
    k_cache,
    v_cache,
    kv_lens,
    block_tables,
    query_start,
    num_seqs,
    *,
    sliding_window,
    logits_soft_cap,
    k_scale,
    v_scale,
    sinks,
) -> None:
    """check_inputs for a stacked-cache kernel, whose cache is `[L, N, B, Hk, D]`."""
    check_inputs(
        q,
        k_cache,
        v_cache,
        kv_lens,
        block_tables,
        query_start,
        num_seqs,
        sliding_window,
        logits_soft_cap,
        k_scale,
        v_scale,
        sinks,
    )
    if k_cache.ndim != 5:
        raise ValueError(f"k_cache must be [L, N, B, Hk, D], got shape {k_cache.shape}")


def check_dtypes(q, k_pages, v_pages) -> None:
    """Pages hold q's dtype, or float8_e4m3fn under float32 or bfloat16 queries; raises ValueError naming the field."""
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype must be float32, bfloat16 or float16, got {q.dtype}")
    if v_pages.dtype != k_pages.dtype:
        raise ValueError(f"v_pages dtype {v_pages.dtype} must equal k_pages dtype {k_pages.dtype}")
    if k_pages.dtype == FP8_PAGES:
        if q.dtype not in FP8_QUERY_DTYPES:
            raise ValueError(f"q dtype must be float32 or bfloat16 with float8_e4m3fn k_pages, got {q.dtype}")
    elif k_pages.dtype != q.dtype:
        raise ValueError(
            f"k_pages/v_pages dtype ({k_pages.dtype}/{v_pages.dtype}) must equal q dtype {q.dtype}"
            " (or be float8_e4m3fn)"
        )


def check_window(sliding_window) -> None:
    """A window is None, a positive int (Python's or a numpy scalar, as a config may hold), or an int32 array of one
    element, possibly traced (any value; <= 0: none)."""
    if sliding_window is None:
        return
    if isinstance(sliding_window, jax.Array | jax.ShapeDtypeStruct | np.ndarray):
        if sliding_window.dtype != jnp.int32 or sliding_window.size != 1:
            raise ValueError(
                "sliding_window must be a Python int or an int32 scalar array, got "
                f"{sliding_window.dtype}{list(sliding_window.shape)}"
            )
    elif not isinstance(sliding_window, int | np.integer) or sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")


def window_operand(sliding_window) -> jax.Array:
    """The window as data, int32[1] (<= 0, and None: no window), so one compiled program serves every layer's
    window: Gemma's local and global layers run in one scan over the layers."""
    return jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32).reshape(1)


def check_scale(name: str, scale) -> None:
    """A KV scale is a positive finite Python float (or int, or numpy float), or a float32 array of one element,
    possibly traced (such as `k_scales[layer]` in the scan over the layers). It multiplies what the pages hold,
    whatever their dtype; 1.0 (the default) for pages stored unscaled."""
    if isinstance(scale, jax.Array | jax.ShapeDtypeStruct | np.ndarray):
        if scale.dtype != jnp.float32 or scale.size != 1:
            raise ValueError(
                f"{name} must be a Python float or a float32 scalar array, got {scale.dtype}{list(scale.shape)}"
            )
    elif isinstance(scale, bool) or not isinstance(scale, int | float | np.integer | np.floating):
        raise ValueError(
            f"{name} must be a Python float or a float32 scalar array, got {type(scale).__name__}"
        )
    elif not (0 < float(scale) < float("inf")):
        raise ValueError(f"{name} must be positive and finite, got {scale}")


def scale_operand(scale) -> jax.Array:
    """A KV scale as data, float32[1], so one compiled program serves every layer's (and checkpoint's) scales."""
    return jnp.asarray(scale, jnp.float32).reshape(1)


def check_sinks(sinks, num_q_heads: int) -> None:
    """Sinks (gpt-oss) are None or a float32 array [Hq], one logit a query head, possibly traced (such as
    `sinks[layer]` in the scan over the layers)."""
    if sinks is None:
        return
    if not isinstance(sinks, jax.Array | jax.ShapeDtypeStruct | np.ndarray):
        raise ValueError(f"sinks must be None or a float32 array [{num_q_heads}], got {type(sinks).__name__}")
    if sinks.dtype != jnp.float32 or sinks.shape != (num_q_heads,):
        raise ValueError(
            f"sinks must be float32[{num_q_heads}] (one a query head), got {sinks.dtype}{list(sinks.shape)}"
        )


def sinks_operand(sinks: jax.Array) -> jax.Array:
    """Sinks as the kernels take them: float32 [Hq], a -inf (no sink) read as NEG_INF like a masked score, so no
    running maximum starts at -inf (-inf minus -inf is NaN)."""
    return jnp.maximum(jnp.asarray(sinks, jnp.float32), NEG_INF)


def floats_operand(k_scale, v_scale, sinks) -> jax.Array:
    """The kernels' float scalars as one float32 operand: k_scale, v_scale, then the Hq sinks where there are some."""
    with_sinks = [] if sinks is None else [sinks_operand(sinks)]
    return jnp.concatenate([scale_operand(k_scale), scale_operand(v_scale), *with_sinks])


def unbounded_if_none(window: jax.Array) -> jax.Array:
    """A kernel's window from the operand's value: one no key reaches past when it is <= 0 (no window), so the
    window's bounds and masks need no branch on it."""
    return jnp.where(window > 0, window, jnp.int32(1 << 30))


def find_tile_sequence(query_start_ref, tile, num_seqs, tile_tokens: int, search_steps: int):
    """Largest s < num_seqs whose first tile (`query_start[s] // tile_tokens + s`) is <= `tile`.

    A binary search over `query_start` read from kernel memory; `lax.div` rather than `//` because the
    operands are non-negative and Mosaic lowers floor division through a sign op it cannot lower off-TPU.
    """

    def step(_, bounds):
        lo, hi = bounds
        mid = lax.div(lo + hi + 1, 2)
        owns = lax.div(query_start_ref[mid], tile_tokens) + mid <= tile
        return jnp.where(owns, mid, lo), jnp.where(owns, hi, mid - 1)

    lo, _ = lax.fori_loop(0, search_steps, step, (jnp.int32(0), num_seqs - 1))
    return lo


def over_pages(stacked: Callable) -> Callable:
    """The pages form of a stacked-cache kernel, `fn(q, k_pages, v_pages, kv_lens, block_tables, query_start,
    num_seqs, *, sm_scale, sliding_window=None, logits_soft_cap=None, k_scale=1.0, v_scale=1.0, sinks=None,
    interpret=False)`: the cache as one layer."""

    def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *metadata, **options):
        """Attention of `q` [T, Hq, D] over pages `[N, B, Hk, D]` (contract in jpaged.pallas); returns [T, Hq, D]."""
        if k_pages.ndim != 4:
            raise ValueError(f"k_pages must be [N, B, Hk, D], got shape {k_pages.shape}")
        return stacked(q, k_pages[None], v_pages[None], jnp.zeros((1,), jnp.int32), *metadata, **options)

    return ragged_paged_attention
