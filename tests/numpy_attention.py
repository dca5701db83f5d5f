"""Float64 numpy ragged paged attention: the slow, obviously-correct oracle the kernels are checked against.

Written from the contract, not from any kernel: gather each sequence's keys page by page, score every query
token against every position it may see, softmax in float64. Padding rows come back as zeros.

`sinks` (gpt-oss, one logit a query head) join each row's softmax as one more column with no value, as
transformers' GptOssAttention concatenates them to the logits and drops their column after the softmax.
"""

from __future__ import annotations

import numpy as np


def ragged_paged_attention_numpy(
    q,
    k_pages,
    v_pages,
    kv_lens,
    block_tables,
    query_start,
    num_seqs,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks=None,
) -> np.ndarray:
    """q [T, Hq, D], pages [N, B, Hk, D], sinks [Hq] or None -> float64 [T, Hq, D]."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    kv_lens, block_tables, query_start = (np.asarray(x) for x in (kv_lens, block_tables, query_start))
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = num_q_heads // num_kv_heads
    out = np.zeros_like(q)
    for s in range(int(np.asarray(num_seqs)[0])):
        begin, end, kv_len = int(query_start[s]), int(query_start[s + 1]), int(kv_lens[s])
        if end == begin:
            continue
        pages = block_tables[s, : -(-kv_len // block_size)]
        keys = k_pages[pages].reshape(-1, num_kv_heads, head_dim)[:kv_len]
        values = v_pages[pages].reshape(-1, num_kv_heads, head_dim)[:kv_len]
        keys, values = np.repeat(keys, group, axis=1), np.repeat(values, group, axis=1)  # [K, Hq, D]
        scores = np.einsum("thd,khd->htk", q[begin:end], keys) * sm_scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * np.tanh(scores / logits_soft_cap)
        q_pos = kv_len - (end - begin) + np.arange(end - begin)
        k_pos = np.arange(kv_len)
        visible = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None and sliding_window > 0:  # an array window <= 0: none
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        scores = np.where(visible[None], scores, -np.inf)
        if sinks is not None:  # the sink's column: [Hq, tokens, 1], never masked, never capped
            sink = np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None], (*scores.shape[:2], 1))
            scores = np.concatenate([scores, sink], axis=-1)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        weights = weights[..., :kv_len]  # the sink's column, if any, has no value
        out[begin:end] = np.einsum("htk,khd->thd", weights, values)
    return out
