"""Ragged paged attention for TPU (Mosaic): mixed prefill chunks and decodes in one launch.

Shapes (letters as in jpaged.pallas.reference): T tokens, S sequence slots, L layers, N blocks, B tokens per
block, P table width, Hq / Hk heads, G = Hq // Hk, D head dim; a tile is `tile_tokens` (TT) query tokens.

Work split: a 1-D grid over query tiles, each holding TT consecutive query tokens of ONE sequence (all heads).
Sequence s owns tiles `query_start[s] // TT + s` onwards and a tile finds its sequence by a binary search over
`query_start` in SMEM (scalar-prefetched with the block tables), as the GPU kernel does. The tile DMAs its query
rows from HBM, then walks only the KV positions its queries can see, `128 // B` pages per step, double-buffered:
whole pages (all Hk heads) come in once and each head is taken out with a strided VMEM load, so a page is read
once per tile whatever the GQA ratio. Output rows go back by DMA; a tile writes all TT rows, and rows that belong
to the next sequence are rewritten by that sequence's tiles, which run later — hence the grid axis is sequential
("arbitrary"), never "parallel".

FP8 pages (float8_e4m3fn) come into VMEM as they are; each head's rows are taken out as 32-bit words of four rows
and decoded to float32 with integer operations (no fp8 arithmetic asked of the TPU), then widened or narrowed to
q's dtype before the dots. The K scale multiplies the scores' scale and the V scale the output, both scalars
prefetched into SMEM beside the window. Sinks (gpt-oss), when given, follow the two scales there, one a query head:
each row's online softmax starts from its head's sink (running maximum the sink, running sum 1).

Layout limits come from Mosaic tiling: Hk must tile VMEM without padding (by the pages' dtype) — float32: 1, 2, 4, 8
or a multiple of 8; bfloat16: 2, 4, 8, 16 or a multiple of 16; float8_e4m3fn: 4, 8, 16, 32 or a multiple of 32 —
and B must divide 128 (or be a multiple of it). Other shapes raise ValueError; use the XLA reference there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jpaged.pallas.common import (
    FP8_PAGES,
    NEG_INF,
    check_stacked_inputs,
    find_tile_sequence,
    floats_operand,
    over_pages,
    unbounded_if_none,
    window_operand,
)

_LANES = 128
DECODE_TILE_TOKENS = 8
PREFILL_TILE_TOKENS = 32
_KV_BUFFER_BYTES = 8 << 20  # the four K/V page buffers together
_DEFAULT_SCOPED_VMEM = 16 << 20  # Mosaic's smallest default scoped-VMEM limit; ask for more only past it


def _packing(dtype) -> int:
    return 4 // jnp.dtype(dtype).itemsize


def check_tpu_layout(num_kv_heads: int, block_size: int, head_dim: int, dtype) -> None:
    """Raises ValueError for head counts, block sizes and head dims this kernel cannot lay out in VMEM, for pages
    of `dtype`."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), FP8_PAGES):
        raise ValueError(
            f"k_pages dtype must be float32, bfloat16 or float8_e4m3fn on TPU, got {jnp.dtype(dtype)}"
        )
    packing = _packing(dtype)
    per_tile = num_kv_heads // packing
    if num_kv_heads % packing or not (per_tile in (1, 2, 4, 8) or per_tile % 8 == 0):
        allowed = ", ".join(str(n * packing) for n in (1, 2, 4, 8)) + f" or a multiple of {8 * packing}"
        raise ValueError(f"k_pages heads ({num_kv_heads}) must be {allowed} for {jnp.dtype(dtype)} on TPU")
    if _LANES % block_size and block_size % _LANES:
        raise ValueError(f"k_pages block size ({block_size}) must divide 128 or be a multiple of 128 on TPU")
    if head_dim > _LANES and head_dim % _LANES:
        raise ValueError(f"head_dim ({head_dim}) must be at most 128 or a multiple of 128 on TPU")


def _scratch_bytes(
    tile_tokens: int, num_kv_heads: int, group: int, head_dim: int, kv_step_bytes: int, dtype
) -> int:
    """VMEM the kernel's scratch takes, counting the padding of (sublane, lane) tiles."""
    sublanes = 8 * _packing(dtype)
    lanes = max(head_dim, _LANES)
    rows = tile_tokens * group
    io = tile_tokens * num_kv_heads * pl.cdiv(group, sublanes) * sublanes * lanes * jnp.dtype(dtype).itemsize
    per_head_f32 = num_kv_heads * rows * 4
    return 2 * io + 4 * kv_step_bytes + per_head_f32 * (2 * _LANES + 2 * lanes)


def _lanes(x: jax.Array, width: int) -> jax.Array:
    """Lane-replicated [R, 128] statistics widened or narrowed to [R, width]."""
    if width <= _LANES:
        return x[:, :width]
    return jnp.concatenate([x] * (width // _LANES), axis=1)


def _take_head(buf, slot, head: int, interpret: bool) -> jax.Array:
    """One head's [K, D] keys or values from the [2, pages, B, Hk, D] VMEM buffer.

    On TPU: view the slot as [K * Hk, D] rows and load rows head, head + Hk, ... with a strided load (Mosaic's
    tested path; JAX's own ragged kernel reads heads this way). Mosaic has no strided sublane load for 16-bit
    types, so those load the packed 32-bit words and shift the wanted half into the high bits (a bfloat16 is the
    top half of a float32). The TPU interpreter models neither ref reshapes nor ref bitcasts, so under
    `interpret` the head is indexed directly; everything else in the kernel is the same code in both modes.
    """
    _, pages, block_size, num_heads, head_dim = buf.shape
    kv_tokens = pages * block_size
    if interpret:
        return buf[slot, :, :, head, :].reshape(kv_tokens, head_dim)
    rows = buf.at[slot].reshape(kv_tokens * num_heads, head_dim)
    if buf.dtype == jnp.float32:
        return rows[pl.ds(head, kv_tokens, stride=num_heads), :]
    if buf.dtype == FP8_PAGES:  # rows 4j .. 4j + 3 share a word, 4j in the low byte
        words = rows.bitcast(jnp.int32)[pl.ds(head // 4, kv_tokens, stride=num_heads // 4), :]
        return _e4m3_to_float32(jnp.bitwise_and(jnp.right_shift(words, 8 * (head % 4)), jnp.int32(0xFF)))
    words = rows.bitcast(jnp.int32)  # row pairs (2j, 2j + 1) share a word, 2j in the low half
    packed = words[pl.ds(head // 2, kv_tokens, stride=num_heads // 2), :]
    high = packed if head % 2 else jnp.left_shift(packed, 16)
    return pltpu.bitcast(jnp.bitwise_and(high, jnp.int32(-65536)), jnp.float32).astype(buf.dtype)


def _e4m3_to_float32(bits: jax.Array) -> jax.Array:
    """float8_e4m3fn values from their bits (int32 in [0, 256)) by integer operations: a normal number's exponent
    and mantissa move into float32's fields, rebiased (7 to 127); a subnormal is its mantissa times 2^-9. The NaN
    pattern reads as 480 (the cache never holds it)."""
    magnitude = jnp.bitwise_and(bits, jnp.int32(0x7F))
    normal = lax.bitcast_convert_type(jnp.left_shift(magnitude, 20) + jnp.int32(120 << 23), jnp.float32)
    subnormal = magnitude.astype(jnp.float32) * jnp.float32(2.0**-9)
    value = jnp.where(magnitude < 8, subnormal, normal)
    return jnp.where(jnp.bitwise_and(bits, jnp.int32(0x80)) != 0, -value, value)


def _kernel(
    # scalar prefetch (SMEM)
    layer_ref,  # [1]
    window_ref,  # [1], <= 0: no window (read only when `windowed`)
    floats_ref,  # [2] float32: k_scale, v_scale; [2 + Hq] with sinks, each query head's sink after them
    kv_lens_ref,  # [S]
    tables_ref,  # [S * P]
    query_start_ref,  # [S + 1]
    num_seqs_ref,  # [1]
    # HBM
    q_hbm,  # [T + TT, Hk, G, D]
    k_hbm,  # [L, N, B, Hk, D]
    v_hbm,  # [L, N, B, Hk, D]
    out_init_hbm,  # [T + TT, Hk, G, D], aliased to out_hbm
    out_hbm,  # [T + TT, Hk, G, D]
    # VMEM scratch
    q_buf,  # [TT, Hk, G, D]
    q_rows,  # [Hk, TT * G, D]
    k_buf,  # [2, pages_per_step, B, Hk, D]
    v_buf,  # [2, pages_per_step, B, Hk, D]
    m_ref,  # [Hk, TT * G, 128] f32
    l_ref,  # [Hk, TT * G, 128] f32
    acc_ref,  # [Hk, TT * G, D] f32
    o_buf,  # [TT, Hk, G, D]
    kv_sems,  # DMA [2, 2]
    io_sem,  # DMA
    *,
    sm_scale: float,
    windowed: bool,
    soft_cap: float | None,
    has_sinks: bool,
    table_width: int,
    search_steps: int,
    interpret: bool,
):
    del out_init_hbm  # only there so rows no tile writes (padding) read as zeros
    tile_tokens, num_kv_heads, group, head_dim = q_buf.shape
    pages_per_step, block_size = k_buf.shape[1], k_buf.shape[2]
    kv_tokens = pages_per_step * block_size
    rows = tile_tokens * group
    tile = pl.program_id(0)

    num_seqs = num_seqs_ref[0]

    seq = find_tile_sequence(query_start_ref, tile, num_seqs, tile_tokens, search_steps)
    q_begin = query_start_ref[seq]
    q_len = query_start_ref[seq + 1] - q_begin
    first_token = (tile - (lax.div(q_begin, tile_tokens) + seq)) * tile_tokens
    last_tile = lax.div(query_start_ref[num_seqs], tile_tokens) + num_seqs
    active = (tile < last_tile) & (first_token < q_len)

    @pl.when(active)
    def _attend():
        layer = layer_ref[0]
        kv_len = kv_lens_ref[seq]
        row0 = q_begin + first_token
        q_copy = pltpu.make_async_copy(q_hbm.at[pl.ds(row0, tile_tokens)], q_buf, io_sem)
        q_copy.start()

        kv_end = kv_len - q_len + jnp.minimum(first_token + tile_tokens, q_len)
        first_page = jnp.int32(0)
        if windowed:
            window = unbounded_if_none(window_ref[0])
            first_page = lax.div(jnp.maximum(kv_len - q_len + first_token - window + 1, 0), block_size)
        num_pages = pl.cdiv(kv_len, block_size)
        num_steps = pl.cdiv(kv_end - first_page * block_size, kv_tokens)

        def kv_copies(step, slot):
            copies = []
            for i in range(pages_per_step):
                page = first_page + step * pages_per_step + i
                safe_page = jnp.minimum(page, table_width - 1)
                block = jnp.where(page < num_pages, tables_ref[seq * table_width + safe_page], 0)
                for buf, hbm, j in ((k_buf, k_hbm, 0), (v_buf, v_hbm, 1)):
                    copies.append(
                        pltpu.make_async_copy(hbm.at[layer, block], buf.at[slot, i], kv_sems.at[slot, j])
                    )
            return copies

        for copy in kv_copies(0, 0):
            copy.start()
        if has_sinks:  # each row's softmax starts from its head's sink: maximum the sink, sum 1
            row_head = lax.rem(lax.broadcasted_iota(jnp.int32, (rows, _LANES), 0), group)  # rows: (token, g)
            for h in range(num_kv_heads):
                start = jnp.full((rows, _LANES), NEG_INF, jnp.float32)
                for g in range(group):
                    start = jnp.where(row_head == g, floats_ref[2 + h * group + g], start)
                m_ref[h] = start
            l_ref[...] = jnp.ones(l_ref.shape, jnp.float32)
        else:
            m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        q_copy.wait()
        for h in range(num_kv_heads):
            q_h = q_buf[:, h]  # [TT, G, D]
            if group % _packing(q_h.dtype):  # Mosaic folds unaligned 16-bit rows only through float32
                q_h = q_h.astype(jnp.float32)
            q_rows[h] = q_h.reshape(rows, head_dim).astype(q_rows.dtype)

        score_scale = sm_scale * floats_ref[0]
        row_token = first_token + lax.div(lax.broadcasted_iota(jnp.int32, (rows, kv_tokens), 0), group)
        q_pos = kv_len - q_len + row_token

        def step_body(step, carry):
            slot = lax.rem(step, 2)

            @pl.when(step + 1 < num_steps)
            def _prefetch():
                for copy in kv_copies(step + 1, 1 - slot):
                    copy.start()

            for copy in kv_copies(step, slot):
                copy.wait()
            k_pos = (first_page * block_size + step * kv_tokens) + lax.broadcasted_iota(
                jnp.int32, (rows, kv_tokens), 1
            )
            visible = (k_pos <= q_pos) & (k_pos < kv_len)
            if windowed:
                visible &= k_pos > q_pos - window
            v_rows = (first_page * block_size + step * kv_tokens) + lax.broadcasted_iota(
                jnp.int32, (kv_tokens, head_dim), 0
            )
            for h in range(num_kv_heads):
                k = _take_head(k_buf, slot, h, interpret)
                v = _take_head(v_buf, slot, h, interpret)
                if k_buf.dtype == FP8_PAGES:  # widened (from float32 on TPU) to q's dtype for the dots
                    k, v = k.astype(q_buf.dtype), v.astype(q_buf.dtype)
                # Pages arrive whole: zero the slots past kv_len, whose stale contents (even NaN) p @ v would mix in.
                v = jnp.where(v_rows < kv_len, v, jnp.zeros_like(v))
                q_h = q_rows[h]
                scores = (
                    lax.dot_general(
                        q_h, k.astype(q_h.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
                    )
                    * score_scale
                )
                if soft_cap is not None:
                    scores = soft_cap * jnp.tanh(scores / soft_cap)
                scores = jnp.where(visible, scores, NEG_INF)
                m_prev, l_prev = m_ref[h], l_ref[h]  # [R, 128], lane-replicated
                m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
                p = jnp.where(visible, jnp.exp(scores - _lanes(m_new, kv_tokens)), 0.0)
                correction = jnp.exp(m_prev - m_new)
                l_ref[h] = l_prev * correction + jnp.sum(p, axis=1, keepdims=True)
                m_ref[h] = m_new
                pv = lax.dot_general(
                    p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
                )
                acc_ref[h] = acc_ref[h] * _lanes(correction, head_dim) + pv
            return carry

        lax.fori_loop(0, num_steps, step_body, 0)
        for h in range(num_kv_heads):
            denom = _lanes(l_ref[h], head_dim)
            out = acc_ref[h] * floats_ref[1] / jnp.where(denom > 0, denom, 1.0)
            o_buf[:, h] = out.reshape(tile_tokens, group, head_dim).astype(o_buf.dtype)
        out_copy = pltpu.make_async_copy(o_buf, out_hbm.at[pl.ds(row0, tile_tokens)], io_sem)
        out_copy.start()
        out_copy.wait()


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
    interpret: bool | pltpu.InterpretParams = False,
    tile_tokens: int | None = None,
) -> jax.Array:
    """Attention over layer `layer` of a stacked cache `[L, N, B, Hk, D]`, read in place.

    `tile_tokens` overrides the static choice (decode-heavy buckets, T <= 2 S: 8 tokens; otherwise 32).
    With `interpret=True` the kernel runs in Pallas' TPU simulator (DMAs, semaphores, NaN-filled scratch).
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
    num_layers, num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if q.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"q dtype must be float32 or bfloat16 on TPU, got {q.dtype}")
    check_tpu_layout(num_kv_heads, block_size, head_dim, k_cache.dtype)
    num_seq_slots, table_width = block_tables.shape
    group = num_q_heads // num_kv_heads
    if tile_tokens is None:
        tile_tokens = DECODE_TILE_TOKENS if num_tokens <= 2 * num_seq_slots else PREFILL_TILE_TOKENS
    page_bytes = block_size * num_kv_heads * head_dim * k_cache.dtype.itemsize
    pages_per_step = max(1, min(_LANES // block_size, _KV_BUFFER_BYTES // (4 * page_bytes)))
    rows = tile_tokens * group
    # Odd groups of 16-bit queries are folded through float32 (see the kernel), so their rows stay float32.
    rows_dtype = jnp.float32 if group % _packing(q.dtype) else q.dtype

    vmem_bytes = _scratch_bytes(
        tile_tokens, num_kv_heads, group, head_dim, pages_per_step * page_bytes, q.dtype
    )
    grouped = jnp.pad(
        q.reshape(num_tokens, num_kv_heads, group, head_dim), ((0, tile_tokens), (0, 0), (0, 0), (0, 0))
    )
    kv_buf = pltpu.VMEM((2, pages_per_step, block_size, num_kv_heads, head_dim), k_cache.dtype)
    stats = pltpu.VMEM((num_kv_heads, rows, _LANES), jnp.float32)
    io_buf = pltpu.VMEM((tile_tokens, num_kv_heads, group, head_dim), q.dtype)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    scalars = (
        jnp.reshape(layer, (1,)).astype(jnp.int32),
        window_operand(sliding_window),
        floats_operand(k_scale, v_scale, sinks),
        kv_lens,
        block_tables.reshape(-1),  # 1-D: a 2-D SMEM array pads its rows
        query_start,
        num_seqs,
    )
    kernel = functools.partial(
        _kernel,
        sm_scale=float(sm_scale),
        windowed=sliding_window is not None,
        soft_cap=logits_soft_cap,
        has_sinks=sinks is not None,
        table_width=table_width,
        search_steps=max(1, int(num_seq_slots).bit_length()),
        interpret=bool(interpret),
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(pl.cdiv(num_tokens, tile_tokens) + num_seq_slots,),
            in_specs=[hbm, hbm, hbm, hbm],
            out_specs=hbm,
            scratch_shapes=[
                io_buf,
                pltpu.VMEM((num_kv_heads, rows, head_dim), rows_dtype),
                kv_buf,
                kv_buf,
                stats,
                stats,
                pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),
                io_buf,
                pltpu.SemaphoreType.DMA((2, 2)),
                pltpu.SemaphoreType.DMA(()),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(grouped.shape, q.dtype),
        input_output_aliases={len(scalars) + 3: 0},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=None
            if vmem_bytes <= _DEFAULT_SCOPED_VMEM
            else vmem_bytes + _DEFAULT_SCOPED_VMEM // 2,
        ),
        interpret=interpret
        if isinstance(interpret, pltpu.InterpretParams)
        else interpret and pltpu.InterpretParams(),
        name="ragged_paged_attention_tpu",
    )(*scalars, grouped, k_cache, v_cache, jnp.zeros_like(grouped))
    return out[:num_tokens].reshape(num_tokens, num_q_heads, head_dim)


ragged_paged_attention = over_pages(ragged_paged_attention_stacked)
