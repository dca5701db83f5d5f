"""Pure-XLA ragged paged attention: the reference the Pallas kernels are tested against and the CPU path.

Shapes (letters used throughout jpaged):
  T  query tokens in the step (padded bucket)      S  sequences in the step (padded bucket)
  N  physical KV blocks                            B  tokens per block
  P  block-table width (pages per sequence)        Hq / Hk  query / KV heads, D  head dim

It works like the kernels do, so its cost follows the real work rather than the padded shapes: an online softmax
over chunks of each sequence's own pages, with loop trip counts taken from the data (`kv_lens`), never from
`max_model_len`. The last query token of every sequence (all of a decode step) is computed for all sequences at
once; the other tokens of prefill chunks go tile by tile through a loop over the sequences up to the last
prefill (the scheduler puts running decodes first, so a decode step runs no iteration of it).

Sinks (gpt-oss: a logit a query head that joins every row's softmax denominator and has no value) start each
row's online softmax: running maximum the sink, running sum 1 (its exp at that maximum).

Pages may be float8_e4m3fn (`--kv-cache-dtype fp8`): widened to float32 like the others, the K scale folded into
the queries' scale and the V scale into the output, so no page element is multiplied.

Unlike the kernels, it reads whole pages and masks scores, so slots past a sequence's length must hold finite
values (the engine's pool is zero-initialised and only ever written with finite K/V).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jpaged.pallas.common import (
    NEG_INF,
    check_dtypes,
    check_scale,
    check_sinks,
    check_window,
    scale_operand,
    sinks_operand,
    window_operand,
)
from jpaged.rounding import cdiv

# Prefill query rows per loop iteration: fewer iterations, each a bigger dot; a partial tile's padding rows cost
# little next to that (measured: scripts/KERNELS.md, "Choices in the code").
_QUERY_TILE = 128
# KV tokens gathered per online-softmax iteration. Small chunks keep the gathered pages in cache (KERNELS.md).
_LAST_ROW_CHUNK_TOKENS = 32
_TILE_CHUNK_TOKENS = 256


def ragged_paged_attention_reference(
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
) -> jax.Array:
    """Attention of `q` [T, Hq, D] over pages `[N, B, Hk, D]`; see jpaged.pallas for the full contract."""
    del interpret  # same signature as the kernels
    return paged_attention_stacked(
        q,
        k_pages[None],
        v_pages[None],
        jnp.int32(0),
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


def paged_attention_stacked(
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
) -> jax.Array:
    """The reference over one layer of a stacked cache `[L, N, B, Hk, D]`.

    Indexing the layer inside the gathers (rather than slicing `k_cache[layer]` first) lets XLA read the pages in
    place inside the model's layer scan instead of copying a whole layer's pool every step.
    """
    check_dtypes(q, k_cache, v_cache)
    check_window(sliding_window)
    check_scale("k_scale", k_scale)
    check_scale("v_scale", v_scale)
    check_sinks(sinks, q.shape[1])
    score_scale = sm_scale * scale_operand(k_scale)[0]
    window = None if sliding_window is None else window_operand(sliding_window)[0]
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[2], k_cache.shape[3]
    group = num_q_heads // num_kv_heads
    head_sinks = None if sinks is None else sinks_operand(sinks).reshape(num_kv_heads, 1, group)
    width = block_tables.shape[1]
    num_seq_slots = kv_lens.shape[0]
    seq_ids = jnp.arange(num_seq_slots)
    live = seq_ids < num_seqs[0]
    q_lens = jnp.where(live, query_start[1:] - query_start[:-1], 0)
    kv_lens = jnp.where(live, kv_lens, 0)

    def attend(queries, positions, tables, kv_lens, chunk_tokens):
        """Online softmax of queries [S', R, Hk, G, D] at `positions` [S', R] over each row's own pages, read
        `chunk_tokens` at a time.

        Batched over sequences with plain einsums (no vmap): XLA CPU turns vmapped loops of tiny dots into slow
        code, and one batched dot per chunk is what a decode step needs.
        """
        seqs, rows = queries.shape[:2]
        queries = queries.astype(jnp.float32).transpose(0, 2, 1, 3, 4) * score_scale
        pages_per_chunk = max(1, chunk_tokens // block_size)
        chunk_len = pages_per_chunk * block_size
        padded_width = cdiv(width, pages_per_chunk) * pages_per_chunk
        tables = jnp.pad(tables, ((0, 0), (0, padded_width - width)))
        num_chunks = (jnp.minimum(jnp.max(positions) + 1, jnp.max(kv_lens)) + chunk_len - 1) // chunk_len

        def body(c, state):
            m, denom, acc = state
            pages = jax.lax.dynamic_slice_in_dim(tables, c * pages_per_chunk, pages_per_chunk, axis=1)
            shape = (seqs, chunk_len, num_kv_heads, head_dim)
            keys = k_cache[layer, pages].reshape(shape).astype(jnp.float32)
            values = v_cache[layer, pages].reshape(shape).astype(jnp.float32)
            scores = jnp.einsum("skrgd,slkd->skrgl", queries, keys)
            if logits_soft_cap is not None:
                scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
            key_pos = c * chunk_len + jnp.arange(chunk_len)
            in_context = key_pos[None, :] < kv_lens[:, None]  # [S', L]
            mask = (key_pos[None, None, :] <= positions[:, :, None]) & in_context[:, None, :]
            if window is not None:
                mask &= (window <= 0) | (key_pos[None, None, :] > positions[:, :, None] - window)
            mask = mask[:, None, :, None, :]
            scores = jnp.where(mask, scores, NEG_INF)
            m_new = jnp.maximum(m, scores.max(-1))
            p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            denom = denom * correction + p.sum(-1)
            acc = acc * correction[..., None] + jnp.einsum("skrgl,slkd->skrgd", p, values)
            return m_new, denom, acc

        stats = (seqs, num_kv_heads, rows, group)
        if head_sinks is None:
            start = (jnp.full(stats, NEG_INF, jnp.float32), jnp.zeros(stats, jnp.float32))
        else:  # each row's softmax starts from its head's sink: maximum the sink, sum 1 (the sink's exp)
            start = (jnp.broadcast_to(head_sinks, stats), jnp.ones(stats, jnp.float32))
        init = (*start, jnp.zeros((*stats, head_dim)))
        _, denom, acc = jax.lax.fori_loop(0, num_chunks, body, init)
        return (acc / jnp.maximum(denom, 1e-30)[..., None]).transpose(0, 2, 1, 3, 4)

    grouped = q.reshape(num_tokens, num_kv_heads, group, head_dim)

    # Last token of every sequence: one batched pass (the whole of a decode step).
    last_rows = jnp.clip(query_start[1:] - 1, 0, num_tokens - 1)
    last_out = attend(
        grouped[last_rows][:, None], (kv_lens - 1)[:, None], block_tables, kv_lens, _LAST_ROW_CHUNK_TOKENS
    )[:, 0]

    # Remaining prefill rows, tile by tile, sequence by sequence; the query array is padded by one tile so
    # dynamic slices never clamp.
    padded_q = jnp.pad(grouped, ((0, _QUERY_TILE), (0, 0), (0, 0), (0, 0)))
    out = jnp.zeros((num_tokens + _QUERY_TILE, num_kv_heads, group, head_dim), jnp.float32)

    def per_sequence(s, out):
        start, q_len, kv_len = query_start[s], q_lens[s], kv_lens[s]
        num_tiles = (q_len - 1 + _QUERY_TILE - 1) // _QUERY_TILE  # the last row is done above

        def per_tile(t, out):
            row0 = start + t * _QUERY_TILE
            offsets = t * _QUERY_TILE + jnp.arange(_QUERY_TILE)
            positions = kv_len - q_len + offsets
            queries = jax.lax.dynamic_slice_in_dim(padded_q, row0, _QUERY_TILE)
            tile = attend(
                queries[None], positions[None], block_tables[s][None], kv_len[None], _TILE_CHUNK_TOKENS
            )[0]
            keep = (offsets < q_len - 1)[:, None, None, None]
            old = jax.lax.dynamic_slice_in_dim(out, row0, _QUERY_TILE)
            return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, tile, old), row0, 0)

        return jax.lax.fori_loop(0, num_tiles, per_tile, out)

    num_prefills = jnp.max(jnp.where(q_lens > 1, seq_ids + 1, 0))  # sequences past it are all decodes
    out = jax.lax.fori_loop(0, num_prefills, per_sequence, out)[:num_tokens]
    last_rows = jnp.where(live & (q_lens > 0), last_rows, num_tokens)  # padding sequences write nowhere
    out = out.at[last_rows].set(last_out, mode="drop") * scale_operand(v_scale)[0]
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
