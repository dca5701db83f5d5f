"""Ragged paged attention for Hopper and later on Mosaic GPU (`plgpu.kernel`): mixed prefill chunks and decodes.

Shapes (letters as in jpaged.pallas.reference; G = Hq // Hk): the kernel works on query tiles of R rows (the
products' M: 64 for Hopper's wgmma, 128 for Blackwell's tcgen05), each packing `R // G` consecutive tokens of ONE
sequence times the G query heads that share a KV head.
XLA lays the queries out as tiles before the launch (`[Hk, tiles, R, D]`, padding rows zero) and gathers the
output tiles back to `[T, Hq, D]` after it, so every copy the kernel makes is a whole TMA box and no tile ever
writes a row another tile owns. Sequence s owns tiles `query_start[s] // tile_tokens + s` onwards, as in the Triton
kernel; the tile-to-sequence map is computed by XLA too (a tile no sequence owns is marked -1 and exits at once).

The grid is (Hk, tiles). A program copies its query tile into shared memory, then walks its sequence's KV positions
in steps of KV_TOKENS (64, or one page when pages are longer): each step's pages come through the block table by
TMA copies into one of `stages` shared-memory slots (as many as fit, up to 4), the copies for step i + stages - 1
issued before step i is
computed. Scores are one product (`q @ k.T`), the softmax is online in float32 registers, and `p @ v` a second
product with p staged in shared memory: wgmma on Hopper; on Blackwell tcgen05 into tensor memory, waited on its
barrier and loaded to registers. V rows past the sequence's end are zeroed in shared memory before that wgmma,
so stale cache contents (even NaN) never reach the output.

Split-KV (split_kv.py): a decode bucket with few sequence slots splits each KV range `num_splits` ways, a third
grid axis; each part is written normalised by its own sum, with its running max and sum, and XLA combines them.

What it takes: 16-bit queries and pages (bfloat16, float16), head dims a multiple of 64 (the 128-byte swizzle of
a 16-bit row), GQA groups of at most R heads and power-of-two pages (8-128 tokens). `check_layout` says which
condition a shape misses; the dispatcher then takes the Triton kernel for it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jpaged.pallas.common import (
    FP8_PAGES,
    NEG_INF,
    check_stacked_inputs,
    floats_operand,
    over_pages,
    unbounded_if_none,
    window_operand,
)
from jpaged.pallas.split_kv import choose_num_splits, combine_splits

ARCHS = ("hopper", "blackwell")  # products by wgmma (sm_90a) or by tcgen05 into tensor memory (sm_100a)
TILE_ROWS = {"hopper": 64, "blackwell": 128}  # query rows (tokens x GQA heads) of one tile: each product's M
KV_TOKENS = 64  # keys a step attends to (at least one page)
MAX_STAGES = 4  # shared-memory slots of the KV pipeline, where they fit
SMEM_BUDGET = (
    216 * 1024
)  # of the 227 KiB a block may take on Hopper and Blackwell: room for Mosaic's own scratch


def arch_for(compute_capability: str | None) -> str | None:
    """The kernel's products for a GPU: Hopper's wgmma on 9.x, tcgen05 on datacenter Blackwell (10.x); None where
    neither runs (before Hopper, and consumer Blackwell's 12.x, which has no tcgen05)."""
    major = int(float(compute_capability)) if compute_capability else 0
    return {9: "hopper", 10: "blackwell"}.get(major)


def _layout(arch: str):
    """The register layout the products leave their results in, which the softmax's masks follow."""
    return plgpu.Layout.TCGEN05 if arch == "blackwell" else plgpu.Layout.WGMMA


def shared_memory_bytes(
    kv_tokens: int, head_dim: int, itemsize: int, page_itemsize: int, stages: int, rows: int
) -> int:
    """The query tile, p, `stages` slots of K and V pages, and (FP8 pages) one slot of each widened."""
    widened = 2 * kv_tokens * head_dim * itemsize if page_itemsize != itemsize else 0
    pages = 2 * stages * kv_tokens * head_dim * page_itemsize
    return (rows * head_dim + rows * kv_tokens) * itemsize + pages + widened


def pipeline_stages(kv_tokens: int, head_dim: int, itemsize: int, page_itemsize: int, rows: int) -> int:
    """The KV pipeline's depth: the most slots (2 to MAX_STAGES) that fit in shared memory; deeper pipelines keep
    more copies in flight, which is what decode's bandwidth needs."""
    fits = [
        n
        for n in range(2, MAX_STAGES + 1)
        if shared_memory_bytes(kv_tokens, head_dim, itemsize, page_itemsize, n, rows) <= SMEM_BUDGET
    ]
    return max(fits, default=2)


SWIZZLE = 128  # bytes: a 16-bit row of 64 elements
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
KERNEL_CALL = "mosaic_gpu_v2"  # the custom call a Mosaic GPU kernel lowers to


def check_layout(
    num_q_heads: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype,
    kv_dtype=None,
    arch: str = "hopper",
) -> None:
    """Raises ValueError naming the condition a cache layout misses for this kernel's wgmma tiles: `dtype` is the
    queries' (and the model's), `kv_dtype` the pages' (default `dtype`; float8_e4m3fn pages are widened)."""
    dtype, kv_dtype = jnp.dtype(dtype), jnp.dtype(kv_dtype or dtype)
    if dtype not in DTYPES:
        raise ValueError(f"the Mosaic GPU kernel takes bfloat16 or float16 queries and pages, not {dtype}")
    if kv_dtype not in (dtype, FP8_PAGES):
        raise ValueError(
            f"the Mosaic GPU kernel reads pages of the queries' dtype or float8_e4m3fn, not {kv_dtype}"
        )
    if head_dim % 64:
        raise ValueError(f"the Mosaic GPU kernel needs a head dim that is a multiple of 64, not {head_dim}")
    rows = TILE_ROWS[arch]
    if num_q_heads // num_kv_heads > rows:
        raise ValueError(f"the Mosaic GPU kernel packs at most {rows} query heads a KV head")
    if block_size not in (8, 16, 32, 64, 128):
        raise ValueError(
            f"the Mosaic GPU kernel needs pages of 8-128 tokens (a power of two), not {block_size}"
        )
    kv_tokens = max(KV_TOKENS, block_size)
    if shared_memory_bytes(kv_tokens, head_dim, dtype.itemsize, kv_dtype.itemsize, 2, rows) > SMEM_BUDGET:
        raise ValueError(
            f"the Mosaic GPU kernel's two-stage pipeline of {block_size}-token pages with head dim {head_dim} needs "
            f"more than {SMEM_BUDGET // 1024} KiB of shared memory"
        )


def interpret_params(detect_races: bool = True):
    """GPU interpret mode's parameters (jax >= 0.11 exports them from plgpu; jax 0.10 keeps them private)."""
    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    return params(detect_races=detect_races)


def _swizzled(shape: tuple[int, ...], dtype) -> plgpu.SMEM:
    """A shared-memory buffer in the layout wgmma and TMA read: 8-row tiles of one swizzle's width (128 bytes, or
    the whole row where it is shorter: 64 float8 elements)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(SWIZZLE, shape[-1] * itemsize)
    transforms = (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def _kernel(
    ints_ref,  # [2]: layer, window (<= 0: none)
    floats_ref,  # [2 (+ Hq)]: k_scale, v_scale (then each query head's sink)
    kv_lens_ref,  # [S]
    block_tables_ref,  # [S, P]
    query_start_ref,  # [S + 1]
    tile_seq_ref,  # [tiles]: the sequence a tile serves, -1 for none
    tile_first_ref,  # [tiles]: the tile's first token within its sequence
    q_ref,  # [Hk, tiles, R, D]
    k_ref,  # [L, N, B, Hk, D]
    v_ref,
    *outputs,
    q_smem,  # [R, D]
    k_pages,  # [stages, kv_tokens, D], the pages' dtype: where TMA copies them
    v_pages,
    p_smem,  # [R, kv_tokens]
    q_barrier,
    k_barriers,
    v_barriers,
    row_smem=None,  # [R] float32, with several splits
    k_wide=None,  # [kv_tokens, D] q's dtype, for FP8 pages: the step's pages widened for the products
    v_wide=None,
    scores_tmem=None,  # Blackwell: the products' accumulators in tensor memory, and their completion barriers
    values_tmem=None,
    scores_done=None,
    values_done=None,
    arch: str,
    sm_scale: float,
    windowed: bool,
    soft_cap: float | None,
    has_sinks: bool,
    group: int,
    kv_tokens: int,
    stages: int,
    num_splits: int,
):
    """`outputs`: with one split o [1, Hk, tiles, R, D]; with several, o (each split's part normalised by its
    own sum) and that part's running max and sum [K, Hk, tiles, R]."""
    o_ref = outputs[0]
    rows, layout = TILE_ROWS[arch], _layout(arch)

    def product(a, b, tmem, done):
        """a @ b in float32 registers (a, b in shared memory): one wgmma, or one tcgen05 into tensor memory."""
        if arch == "blackwell":
            plgpu.tcgen05_mma(tmem, a, b, done, accumulate=False)
            plgpu.barrier_wait(done)
            result = plgpu.async_load_tmem(tmem)
            plgpu.wait_load_tmem()
            return result

        def wgmma(acc_ref):
            plgpu.wgmma(acc_ref, a, b)
            return acc_ref[...]

        return pl.run_scoped(wgmma, plgpu.ACC((a.shape[0], b.shape[1]), jnp.float32))

    block_size = k_ref.shape[2]
    table_width = block_tables_ref.shape[1]
    pages_per_step = kv_tokens // block_size
    tile_tokens = rows // group
    kv_head, tile, split = lax.axis_index("kv_heads"), lax.axis_index("tiles"), lax.axis_index("splits")
    seq = tile_seq_ref[tile]

    @pl.when(seq >= 0)
    def _attend():
        layer = ints_ref[0]
        first = tile_first_ref[tile]
        q_len = query_start_ref[seq + 1] - query_start_ref[seq]
        kv_len = kv_lens_ref[seq]
        context = kv_len - q_len  # keys before the chunk's first query
        kv_end = context + jnp.minimum(first + tile_tokens, q_len)  # one past the last visible key
        kv_begin = jnp.int32(0)
        if windowed:
            window = unbounded_if_none(ints_ref[1])
            kv_begin = jnp.maximum(context + first - window + 1, 0)
            kv_begin = lax.div(kv_begin, jnp.int32(kv_tokens)) * kv_tokens
        num_steps = lax.div(kv_end - kv_begin + kv_tokens - 1, jnp.int32(kv_tokens))
        steps_per_split = lax.div(num_steps + num_splits - 1, jnp.int32(num_splits))
        first_step = split * steps_per_split
        last_step = jnp.minimum(first_step + steps_per_split, num_steps)

        plgpu.copy_gmem_to_smem(q_ref.at[kv_head, tile], q_smem, q_barrier)

        def fetch(step, slot):
            """Issue the copies of step `step`'s pages into slot `slot` (a page past the sequence reads block 0,
            whose keys are masked and values zeroed)."""
            for j in range(pages_per_step):
                position = kv_begin + step * kv_tokens + j * block_size
                page = jnp.minimum(lax.div(position, jnp.int32(block_size)), table_width - 1)
                block = jnp.where(position < kv_len, block_tables_ref[seq, page], 0)
                rows = pl.ds(j * block_size, block_size)
                source = (layer, block, slice(None), kv_head)
                plgpu.copy_gmem_to_smem(k_ref.at[source], k_pages.at[slot, rows], k_barriers.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[source], v_pages.at[slot, rows], v_barriers.at[slot])

        for stage in range(stages - 1):
            pl.when(first_step + stage < last_step)(functools.partial(fetch, first_step + stage, stage))

        row = plgpu.broadcasted_iota(jnp.int32, (rows, kv_tokens), 0, layout=layout)
        column = plgpu.broadcasted_iota(jnp.int32, (rows, kv_tokens), 1, layout=layout)
        q_position = context + first + row // group
        score_scale = sm_scale * floats_ref[0]

        row_layout = layout.reduce(1)
        m_start = plgpu.layout_cast(jnp.full((rows,), NEG_INF, jnp.float32), row_layout)
        l_start = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), row_layout)
        # A row's softmax starts from its head's sink (max the sink, sum 1), in the first split only.
        if has_sinks:
            head = plgpu.broadcasted_iota(jnp.int32, (rows,), 0, layout=row_layout) % group
            sink = m_start
            for g in range(group):
                sink = jnp.where(head == g, floats_ref[2 + kv_head * group + g], sink)
            first_split = jnp.where(split == 0, 1.0, 0.0)  # scalars: no vector select on a scalar predicate
            m_start = jnp.maximum(sink + (1.0 - first_split) * NEG_INF, NEG_INF)
            l_start = l_start + first_split
        acc_start = plgpu.layout_cast(jnp.zeros((rows, q_smem.shape[-1]), jnp.float32), layout)
        plgpu.barrier_wait(q_barrier)

        def step(i, carry):
            acc, m, denom = carry
            slot = lax.rem(i - first_step, jnp.int32(stages))
            ahead = i + stages - 1  # into the slot step i - 1 has finished with
            pl.when(ahead < last_step)(lambda: fetch(ahead, lax.rem(ahead - first_step, jnp.int32(stages))))
            plgpu.barrier_wait(k_barriers.at[slot])
            keys = k_pages.at[slot]
            if k_wide is not None:  # FP8 pages: widened through float32 (Hopper converts e4m3 to f16 only)
                k_wide[...] = keys[...].astype(jnp.float32).astype(k_wide.dtype)
                plgpu.commit_smem()
                keys = k_wide

            scores = product(q_smem, keys.T, scores_tmem, scores_done) * score_scale
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            k_position = kv_begin + i * kv_tokens + column
            visible = (k_position <= q_position) & (k_position < kv_len)
            if windowed:
                visible &= k_position > q_position - window
            scores = jnp.where(visible, scores, NEG_INF)
            m_new = jnp.maximum(m, scores.max(axis=1))
            correction = jnp.exp(m - m_new)
            p = jnp.where(visible, jnp.exp(scores - lax.broadcast_in_dim(m_new, scores.shape, [0])), 0.0)
            denom = denom * correction + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0])
            p_smem[...] = p.astype(p_smem.dtype)
            plgpu.barrier_wait(v_barriers.at[slot])

            values = v_pages.at[slot]

            def without_stale_values(source, destination):  # p is 0 past the sequence, but 0 x NaN is not
                key = plgpu.broadcasted_iota(jnp.int32, destination.shape, 0, layout=plgpu.Layout.WGMMA)
                stale = kv_begin + i * kv_tokens + key >= kv_len
                widened = source[...].astype(jnp.float32).astype(destination.dtype)
                destination[...] = jnp.where(stale, 0, widened)

            if v_wide is not None:
                without_stale_values(values, v_wide)
                values = v_wide
            else:
                pl.when(kv_begin + (i + 1) * kv_tokens > kv_len)(lambda: without_stale_values(values, values))
            plgpu.commit_smem()

            acc = acc + product(p_smem, values, values_tmem, values_done)
            return acc, m_new, denom

        acc, m, denom = lax.fori_loop(first_step, last_step, step, (acc_start, m_start, l_start))
        scale = floats_ref[1] / jnp.where(denom > 0, denom, 1.0)
        q_smem[...] = (acc * lax.broadcast_in_dim(scale, acc.shape, [0])).astype(q_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[split, kv_head, tile])
        if num_splits > 1:  # the part's max and sum, for the combine; one buffer, one row at a time
            for row_ref, values in zip(outputs[1:], (m, denom), strict=True):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                row_smem[...] = values
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(row_smem, row_ref.at[split, kv_head, tile])
        plgpu.wait_smem_to_gmem(0)


def tile_map(query_start: jax.Array, num_seqs: jax.Array, tile_tokens: int, num_tiles: int):
    """Each tile's sequence (-1: none) and first token within it: sequence s owns `ceil(q_len / tile_tokens)`
    tiles from `query_start[s] // tile_tokens + s`."""
    num_slots = query_start.shape[0] - 1
    slots = jnp.arange(num_slots, dtype=jnp.int32)
    first_tile = jnp.where(slots < num_seqs[0], query_start[:-1] // tile_tokens + slots, jnp.int32(1 << 30))
    tiles = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(first_tile, tiles, side="right").astype(jnp.int32) - 1, 0, num_slots - 1)
    first = (tiles - first_tile[seq]) * tile_tokens
    q_len = query_start[seq + 1] - query_start[seq]
    owned = (tiles >= first_tile[0]) & (first < q_len) & (num_seqs[0] > 0)
    return jnp.where(owned, seq, -1), jnp.where(owned, first, 0)


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
    interpret=False,
    num_splits: int | None = None,
    arch: str = "hopper",
) -> jax.Array:
    """Attention over layer `layer` of a stacked cache `[L, N, B, Hk, D]`, read in place (no per-layer copy).

    `interpret`: True (or GPU interpret mode's parameters) runs the kernel in JAX's GPU interpret mode on the CPU.
    `num_splits` overrides the bucket's split-KV choice (tests use it to run every path on small shapes). `arch`
    names the products: "hopper" (wgmma, 64-row tiles) or "blackwell" (tcgen05 into tensor memory, 128-row tiles).
    """
    check_stacked_inputs(
        q,
        k_cache,
        v_cache,
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
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = k_cache.shape
    check_layout(num_q_heads, num_kv_heads, block_size, head_dim, q.dtype, k_cache.dtype, arch)
    rows = TILE_ROWS[arch]
    group = num_q_heads // num_kv_heads
    tile_tokens = rows // group
    num_tiles = pl.cdiv(num_tokens, tile_tokens) + kv_lens.shape[0]
    kv_tokens = max(KV_TOKENS, block_size)
    tile_seq, tile_first = tile_map(query_start, num_seqs, tile_tokens, num_tiles)

    # Query tiles: row r of tile t holds token `first + r // group` of the tile's sequence, head `r % group` of
    # the KV head's group; rows past the tile's tokens (or the sequence's) are zero.
    row = jnp.arange(rows, dtype=jnp.int32)
    token_in_seq = tile_first[:, None] + row // group  # [tiles, rows]
    seq = jnp.maximum(tile_seq, 0)[:, None]
    row_live = (
        (tile_seq[:, None] >= 0)
        & (row < tile_tokens * group)
        & (token_in_seq < query_start[seq + 1] - query_start[seq])
    )
    token = jnp.where(row_live, query_start[seq] + token_in_seq, 0)
    grouped = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    q_tiles = grouped[token, :, (row % group)[None, :]]  # [tiles, rows, Hk, D]
    q_tiles = jnp.where(row_live[..., None, None], q_tiles, 0).transpose(2, 0, 1, 3)

    if num_splits is None:
        max_kv_len = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(num_tokens, kv_lens.shape[0], num_kv_heads, max_kv_len)
    pages = k_cache.dtype
    stages = pipeline_stages(kv_tokens, head_dim, q.dtype.itemsize, pages.itemsize, rows)
    tile_shape = (num_splits, *q_tiles.shape)
    out_type = [jax.ShapeDtypeStruct(tile_shape, q.dtype)]
    scratch = dict(
        q_smem=_swizzled((rows, head_dim), q.dtype),
        k_pages=_swizzled((stages, kv_tokens, head_dim), pages),
        v_pages=_swizzled((stages, kv_tokens, head_dim), pages),
        p_smem=_swizzled((rows, kv_tokens), q.dtype),
        q_barrier=plgpu.Barrier(),
        k_barriers=plgpu.Barrier(num_arrivals=kv_tokens // block_size, num_barriers=stages),
        v_barriers=plgpu.Barrier(num_arrivals=kv_tokens // block_size, num_barriers=stages),
    )
    if num_splits > 1:
        out_type += [jax.ShapeDtypeStruct(tile_shape[:-1], jnp.float32)] * 2
        scratch["row_smem"] = plgpu.SMEM((rows,), jnp.float32)
    if arch == "blackwell":
        scratch.update(
            scores_tmem=plgpu.TMEM((rows, kv_tokens), jnp.float32),
            values_tmem=plgpu.TMEM((rows, head_dim), jnp.float32),
            scores_done=plgpu.Barrier(orders_tensor_core=True),
            values_done=plgpu.Barrier(orders_tensor_core=True),
        )
    if pages != q.dtype:
        scratch.update(
            k_wide=_swizzled((kv_tokens, head_dim), q.dtype), v_wide=_swizzled((kv_tokens, head_dim), q.dtype)
        )
    parts = plgpu.kernel(
        functools.partial(
            _kernel,
            arch=arch,
            sm_scale=float(sm_scale),
            windowed=sliding_window is not None,
            soft_cap=logits_soft_cap,
            has_sinks=sinks is not None,
            group=group,
            kv_tokens=kv_tokens,
            stages=stages,
            num_splits=num_splits,
        ),
        out_type=out_type,
        grid=(num_kv_heads, num_tiles, num_splits),
        grid_names=("kv_heads", "tiles", "splits"),
        scratch_types=scratch,
        interpret=interpret_params() if interpret is True else (interpret or None),
        kernel_name="ragged_paged_attention_mgpu",
    )(
        jnp.concatenate([jnp.reshape(layer, (1,)).astype(jnp.int32), window_operand(sliding_window)]),
        floats_operand(k_scale, v_scale, sinks),
        kv_lens,
        block_tables,
        query_start,
        tile_seq,
        tile_first,
        q_tiles,
        k_cache,
        v_cache,
    )

    # Back to [T, Hq, D]: token tau of sequence s (position p in it) sits in tile first_tile[s] + p // tile_tokens,
    # row (p % tile_tokens) * group + g; tokens past the last sequence (bucket padding) are zero.
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    live_end = query_start[num_seqs[0]]
    token_seq = jnp.searchsorted(query_start, tokens, side="right").astype(jnp.int32) - 1
    token_seq = jnp.clip(token_seq, 0, kv_lens.shape[0] - 1)
    position = tokens - query_start[token_seq]
    token_tile = jnp.clip(
        query_start[token_seq] // tile_tokens + token_seq + position // tile_tokens, 0, num_tiles - 1
    )
    token_row = (position % tile_tokens)[:, None] * group + jnp.arange(group, dtype=jnp.int32)[None, :]

    def untiled(x: jax.Array) -> jax.Array:
        """[K, Hk, tiles, rows, ...] -> [K, T, Hq, ...]."""
        rows = x[:, :, token_tile[:, None], token_row]  # [K, Hk, T, G, ...]
        rows = jnp.moveaxis(rows, 1, 2)  # [K, T, Hk, G, ...]
        return rows.reshape(num_splits, num_tokens, num_q_heads, *x.shape[4:])

    if num_splits == 1:
        out = untiled(parts[0])[0]
    else:
        o, maxima, sums = (untiled(x) for x in parts)
        out = combine_splits(o.astype(jnp.float32) * sums[..., None], maxima, sums)
    return jnp.where((tokens < live_end)[:, None, None], out, 0).astype(q.dtype)


ragged_paged_attention = over_pages(ragged_paged_attention_stacked)
