"""Ragged paged attention for Hopper and datacenter Blackwell on Mosaic GPU (`plgpu.kernel`): mixed prefill chunks
and decodes in one launch.

The kernel works on query tiles of R rows, the products' M (64 for Hopper's wgmma, 128 for Blackwell's tcgen05),
which XLA lays out before the launch and takes apart after it (query_tiles.py); a tile no sequence owns exits at once.

The grid is (Hk, tiles, splits). A program copies its query tile into shared memory, then walks its sequence's KV
positions in steps of KV_TOKENS (64, or one page when pages are longer): each step's pages come through the block
table by TMA copies into one of `stages` shared-memory slots (as many as fit, up to 4), the copies for step
i + stages - 1 issued before step i is computed. Scores are one product (`q @ k.T`), the softmax is online in
float32 registers, and `p @ v` a second product with p staged in shared memory: wgmma on Hopper; on Blackwell
tcgen05 into tensor memory, waited on its barrier and loaded to registers. V rows past the sequence's end are zeroed
in shared memory before that product, so stale cache contents (even NaN) never reach the output. FP8 pages are
copied as stored and widened into one 16-bit slot a step.

Split-KV (split_kv.py): a decode bucket with few sequence slots splits each KV range `num_splits` ways, the third
grid axis; each part is written normalised by its own sum, with its running max and sum, and XLA combines them.

What it takes: 16-bit queries over pages of their dtype or float8_e4m3fn, head dims a multiple of 64 (the 128-byte
swizzle of a 16-bit row), GQA groups of at most R heads, power-of-two pages (8-128 tokens) whose two pipeline stages
fit in shared memory. `check_layout` says which condition a shape misses; the dispatcher then takes the Triton
kernel for it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jpaged.pallas.common import (
    NEG_INF,
    check_stacked_inputs,
    floats_operand,
    over_pages,
    unbounded_if_none,
    window_operand,
)
from jpaged.pallas.mosaic_gpu_fit import KV_TOKENS, TILE_ROWS, check_layout, pipeline_stages
from jpaged.pallas.query_tiles import QueryTiles
from jpaged.pallas.split_kv import choose_num_splits, combine_splits


def _layout(arch: str):
    """The register layout the products leave their results in, which the softmax's masks follow."""
    return plgpu.Layout.TCGEN05 if arch == "blackwell" else plgpu.Layout.WGMMA


SWIZZLE = 128  # bytes: a 16-bit row of 64 elements
KERNEL_CALL = "mosaic_gpu_v2"  # the custom call a Mosaic GPU kernel lowers to


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
                values = source[...]
                if values.dtype != destination.dtype:  # FP8: through float32, as the keys
                    values = values.astype(jnp.float32).astype(destination.dtype)
                destination[...] = jnp.where(stale, 0, values)

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
    kv_tokens = max(KV_TOKENS, block_size)
    tiles = QueryTiles.of(num_tokens, query_start, num_seqs, rows, num_q_heads // num_kv_heads)
    q_tiles = tiles.lay_out(q)

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
            group=tiles.group,
            kv_tokens=kv_tokens,
            stages=stages,
            num_splits=num_splits,
        ),
        out_type=out_type,
        grid=(num_kv_heads, tiles.num_tiles, num_splits),
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
        tiles.seq,
        tiles.first,
        q_tiles,
        k_cache,
        v_cache,
    )

    if num_splits == 1:
        out = tiles.taken_apart(num_tokens, parts[0])[0]
    else:
        o, maxima, sums = (tiles.taken_apart(num_tokens, x) for x in parts)
        out = combine_splits(o.astype(jnp.float32) * sums[..., None], maxima, sums)
    return jnp.where(tiles.live(num_tokens)[:, None, None], out, 0).astype(q.dtype)


ragged_paged_attention = over_pages(ragged_paged_attention_stacked)
