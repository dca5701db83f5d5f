"""Ragged paged attention for GPU: one Pallas kernel (Triton lowering) for mixed prefill chunks and decodes.

Shapes (letters as in jpaged.pallas.reference):
  T  query tokens in the step        S  sequence slots        L  layers of a stacked cache
  N  physical KV blocks              B  tokens per block      P  block-table width
  Hq / Hk  query / KV heads          G = Hq // Hk             D  head dim

Work split: the grid is (Hk, query tiles). A query tile holds `rows // G` consecutive query tokens of ONE
sequence times the G query heads that share a KV head, so K/V pages are read once per tile for the whole GQA
group. Sequence s owns tiles `query_start[s] // tile_tokens + s` onwards (at least `ceil(q_len / tile_tokens)` of
them); a tile finds its sequence by a binary search over `query_start` inside the kernel, so no host or XLA
preprocessing is needed, and tiles past their sequence's queries exit at once. Each tile loops (`fori_loop`) over
only the KV positions its queries can see: its sequence's own pages, up to its last query's causal position (and
from its first query's sliding-window start). Softmax is online, in float32.

FP8 pages (float8_e4m3fn) are loaded as they are and widened to q's dtype in registers before the dots; the K scale
multiplies the scores' scale and the V scale the output (operands, so one program serves every layer's).

Sinks (gpt-oss), when given, follow the two scales in the same operand, one a query head: each row's online softmax
starts from its head's sink (running maximum the sink, running sum 1), in the first split only, so that the
combine counts it once.

Tilings are static: a decode-heavy step (T <= 2 S) uses 16-row tiles, anything else 64-row tiles.

Split-KV (flash-decoding, split_kv.py): a decode bucket with few sequence slots splits its KV range `num_splits`
ways, a third grid axis; each program keeps its softmax's running max, sum and unnormalised output for its part,
and XLA combines the parts.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jpaged.pallas.common import (
    NEG_INF,
    check_stacked_inputs,
    find_tile_sequence,
    floats_operand,
    over_pages,
    unbounded_if_none,
    window_operand,
)
from jpaged.pallas.split_kv import choose_num_splits, combine_splits


@dataclasses.dataclass(frozen=True)
class GpuTiling:
    """Static tile sizes. `rows` (query tokens x GQA heads) and `kv_tokens` must be powers of two >= 16."""

    rows: int
    kv_tokens: int
    num_warps: int = 4
    num_stages: int = 2


DECODE_TILING = GpuTiling(rows=16, kv_tokens=128)
PREFILL_TILING = GpuTiling(rows=64, kv_tokens=64)


def choose_tiling(num_tokens: int, num_seq_slots: int, group: int) -> GpuTiling:
    """Decode-heavy buckets (about one token per sequence) take short tiles; prefill buckets take tall ones."""
    tiling = DECODE_TILING if num_tokens <= 2 * num_seq_slots else PREFILL_TILING
    if group > tiling.rows:  # a tile must hold at least one token's whole GQA group
        tiling = dataclasses.replace(tiling, rows=pl.next_power_of_2(group))
    return tiling


def _kernel(
    layer_ref,  # [1]
    window_ref,  # [1], <= 0: no window (read only when `windowed`)
    floats_ref,  # [2] float32: k_scale, v_scale; [2 + Hq] with sinks, each query head's sink after them
    kv_lens_ref,  # [S]
    block_tables_ref,  # [S, P]
    query_start_ref,  # [S + 1]
    num_seqs_ref,  # [1]
    q_ref,  # [T + TT, Hq, D]
    k_ref,  # [L, N, B, D] (this program's KV head)
    v_ref,  # [L, N, B, D]
    *outputs,
    sm_scale: float,
    windowed: bool,
    soft_cap: float | None,
    has_sinks: bool,
    tiling: GpuTiling,
    group: int,
    search_steps: int,
    num_splits: int,
):
    """`outputs`: with one split, (out_init, out) [T + TT, Hq, D]; with several, the initial values then the
    parts: (acc_init, max_init, sum_init, acc, max, sum), acc [K, T + TT, Hq, D] (unnormalised, float32), max and
    sum [K, T + TT, Hq]. Each `*_init` is aliased to its output, so rows no tile writes (padding) keep it."""
    results = outputs[len(outputs) // 2 :]
    head_dim = q_ref.shape[-1]
    lanes = pl.next_power_of_2(head_dim)  # Triton blocks are powers of two; extra lanes are masked
    block_size = k_ref.shape[2]
    table_width = block_tables_ref.shape[1]
    rows, kv_tokens = tiling.rows, tiling.kv_tokens
    tile_tokens = rows // group
    kv_head, tile, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    num_seqs = num_seqs_ref[0]
    seq = find_tile_sequence(query_start_ref, tile, num_seqs, tile_tokens, search_steps)
    q_begin = query_start_ref[seq]
    q_len = query_start_ref[seq + 1] - q_begin
    first_token = (tile - (q_begin // tile_tokens + seq)) * tile_tokens  # within the sequence
    last_tile = query_start_ref[num_seqs] // tile_tokens + num_seqs  # one past the last owned tile
    active = (tile < last_tile) & (first_token < q_len)

    @pl.when(active)
    def _attend():
        layer = layer_ref[0]
        kv_len = kv_lens_ref[seq]
        row = lax.broadcasted_iota(jnp.int32, (rows,), 0)
        token = first_token + row // group  # within the sequence
        row_valid = (row < tile_tokens * group) & (token < q_len)
        q_pos = kv_len - q_len + token  # absolute position of each row's query
        # q and out carry TT rows of padding, so even masked rows index real, distinct memory.
        token_idx = (q_begin + token)[:, None]
        head_idx = (kv_head * group + row % group)[:, None]
        dim_idx = lax.broadcasted_iota(jnp.int32, (1, lanes), 1)
        dim_ok = dim_idx < head_dim
        q_mask = jnp.broadcast_to(dim_ok, (rows, lanes))
        q = pltriton.load(q_ref.at[token_idx, head_idx, dim_idx], mask=q_mask, other=0)  # [rows, lanes]

        kv_end = (
            kv_len - q_len + jnp.minimum(first_token + tile_tokens, q_len)
        )  # one past the last visible key
        kv_begin = jnp.int32(0)
        if windowed:
            window = unbounded_if_none(window_ref[0])
            kv_begin = jnp.maximum(kv_len - q_len + first_token - window + 1, 0)
        kv_begin = kv_begin // block_size * block_size
        num_steps = pl.cdiv(kv_end - kv_begin, kv_tokens)
        precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None  # DEFAULT would mean TF32
        score_scale = sm_scale * floats_ref[0]

        def step(i, carry):
            m, denom, acc = carry
            k_pos = kv_begin + i * kv_tokens + lax.broadcasted_iota(jnp.int32, (kv_tokens,), 0)
            in_seq = k_pos < kv_len
            page = jnp.minimum(k_pos // block_size, table_width - 1)
            block = jnp.where(in_seq, block_tables_ref[seq, page], 0)
            # Masked-off slots are never read: stale (even NaN) cache contents cannot leak in.
            kv_mask = in_seq[:, None] & dim_ok
            kv_idx = (layer, block[:, None], (k_pos % block_size)[:, None], dim_idx)
            # `other` a float: Triton casts it to the pages' type, which for fp8 it does from floats only.
            k = pltriton.load(k_ref.at[kv_idx], mask=kv_mask, other=0.0)  # [kv_tokens, lanes]
            v = pltriton.load(v_ref.at[kv_idx], mask=kv_mask, other=0.0)
            k, v = k.astype(q.dtype), v.astype(q.dtype)  # fp8 pages widened; a no-op for the others
            scores = lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
            )
            scores = scores * score_scale
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            visible = (k_pos[None, :] <= q_pos[:, None]) & in_seq[None, :]
            if windowed:
                visible &= k_pos[None, :] > q_pos[:, None] - window
            scores = jnp.where(visible, scores, NEG_INF)
            m_new = jnp.maximum(m, jnp.max(scores, axis=1))
            p = jnp.where(visible, jnp.exp(scores - m_new[:, None]), 0.0)
            correction = jnp.exp(m - m_new)
            denom = denom * correction + jnp.sum(p, axis=1)
            pv = lax.dot_general(
                p.astype(v.dtype),
                v,
                (((1,), (0,)), ((), ())),
                precision=precision,
                preferred_element_type=jnp.float32,
            )
            return m_new, denom, acc * correction[:, None] + pv

        if has_sinks:  # the sink joins a row's softmax once: in the first split's part (max the sink, sum 1)
            sink = pltriton.load(floats_ref.at[2 + head_idx[:, 0]])
            first = split == 0
            start = (
                jnp.where(first, sink, NEG_INF),
                jnp.ones((rows,), jnp.float32) * first.astype(jnp.float32),
            )
        else:
            start = (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32))
        init = (*start, jnp.zeros((rows, lanes), jnp.float32))
        steps_per_split = pl.cdiv(num_steps, num_splits)
        first_step = split * steps_per_split
        last_step = jnp.minimum(first_step + steps_per_split, num_steps)
        m, denom, acc = lax.fori_loop(first_step, last_step, step, init)
        acc = acc * floats_ref[1]
        store_mask = row_valid[:, None] & dim_ok
        if num_splits == 1:
            (out_ref,) = results
            out = (acc / jnp.where(denom > 0, denom, 1.0)[:, None]).astype(out_ref.dtype)
            pltriton.store(out_ref.at[token_idx, head_idx, dim_idx], out, mask=store_mask)
            return
        acc_ref, max_ref, sum_ref = results
        pltriton.store(acc_ref.at[split, token_idx, head_idx, dim_idx], acc, mask=store_mask)
        rows_idx = (split, token_idx[:, 0], head_idx[:, 0])
        pltriton.store(max_ref.at[rows_idx], m, mask=row_valid)
        pltriton.store(sum_ref.at[rows_idx], denom, mask=row_valid)


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
    tiling: GpuTiling | None = None,
    num_splits: int | None = None,
) -> jax.Array:
    """Attention over layer `layer` of a stacked cache `[L, N, B, Hk, D]`, read in place (no per-layer copy).

    `tiling` and `num_splits` override the static choices (tests use them to run every path on any shapes).
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
    num_seq_slots = kv_lens.shape[0]
    group = num_q_heads // num_kv_heads
    tiling = tiling or choose_tiling(num_tokens, num_seq_slots, group)
    tile_tokens = tiling.rows // group
    if tile_tokens < 1:
        raise ValueError(f"tiling.rows ({tiling.rows}) must be at least the GQA group ({group})")
    num_tiles = pl.cdiv(num_tokens, tile_tokens) + num_seq_slots  # bound on sum_s ceil(q_len_s / tile_tokens)
    if num_splits is None:
        max_kv_len = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(num_tokens, num_seq_slots, num_kv_heads, max_kv_len)
    kernel = functools.partial(
        _kernel,
        sm_scale=float(sm_scale),
        windowed=sliding_window is not None,
        soft_cap=logits_soft_cap,
        has_sinks=sinks is not None,
        tiling=tiling,
        group=group,
        search_steps=max(1, int(num_seq_slots).bit_length()),
        num_splits=num_splits,
    )
    padded_q = jnp.pad(q, ((0, tile_tokens), (0, 0), (0, 0)))
    rows_shape = padded_q.shape[:2]
    if num_splits == 1:
        initial = (jnp.zeros_like(padded_q),)
    else:
        initial = (
            jnp.zeros((num_splits, *padded_q.shape), jnp.float32),
            jnp.full((num_splits, *rows_shape), NEG_INF, jnp.float32),
            jnp.zeros((num_splits, *rows_shape), jnp.float32),
        )
    whole = lambda shape: pl.BlockSpec(shape, lambda h, t, k: (0,) * len(shape))  # noqa: E731
    kv_spec = pl.BlockSpec(
        (num_layers, num_blocks, block_size, None, head_dim), lambda h, t, k: (0, 0, 0, h, 0)
    )
    window = window_operand(sliding_window)
    metadata = (
        jnp.reshape(layer, (1,)).astype(jnp.int32),
        window,
        floats_operand(k_scale, v_scale, sinks),
        kv_lens,
        block_tables,
        query_start,
        num_seqs,
    )
    inputs = (*metadata, padded_q, k_cache, v_cache, *initial)
    first_initial = len(inputs) - len(initial)
    results = pl.pallas_call(
        kernel,
        grid=(num_kv_heads, num_tiles, num_splits),
        in_specs=[whole(x.shape) for x in inputs[: first_initial - 2]]
        + [kv_spec, kv_spec]
        + [whole(x.shape) for x in initial],
        out_specs=[whole(x.shape) for x in initial],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in initial],
        input_output_aliases={first_initial + i: i for i in range(len(initial))},
        compiler_params=pltriton.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(*inputs)
    if num_splits == 1:
        return results[0][:num_tokens]
    return combine_splits(*results)[:num_tokens].astype(q.dtype)


ragged_paged_attention = over_pages(ragged_paged_attention_stacked)
