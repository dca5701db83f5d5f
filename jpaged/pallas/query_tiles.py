"""The query tiles the Mosaic GPU kernel works on, laid out and taken apart by XLA around its launch.

A tile is R rows: `R // G` consecutive tokens of ONE sequence times the G query heads that share a KV head (token-
major). Sequence s owns `ceil(q_len / tile_tokens)` tiles from `query_start[s] // tile_tokens + s` (as in the Triton
kernel), so `cdiv(T, tile_tokens) + S` tiles bound any step. Laying the queries out as `[Hk, tiles, R, D]` before
the launch and gathering the rows back after it costs q-sized copies, small beside the KV pages, and lets the kernel
copy whole TMA boxes and never write a row another tile owns.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def tile_map(query_start: jax.Array, num_seqs: jax.Array, tile_tokens: int, num_tiles: int):
    """Each tile's sequence (-1: none) and first token within it."""
    num_slots = query_start.shape[0] - 1
    slots = jnp.arange(num_slots, dtype=jnp.int32)
    first_tile = jnp.where(slots < num_seqs[0], query_start[:-1] // tile_tokens + slots, jnp.int32(1 << 30))
    tiles = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(first_tile, tiles, side="right").astype(jnp.int32) - 1, 0, num_slots - 1)
    first = (tiles - first_tile[seq]) * tile_tokens
    q_len = query_start[seq + 1] - query_start[seq]
    owned = (tiles >= first_tile[0]) & (first < q_len) & (num_seqs[0] > 0)
    return jnp.where(owned, seq, -1), jnp.where(owned, first, 0)


@dataclasses.dataclass(frozen=True)
class QueryTiles:
    """A step's tiling: `seq` and `first` per tile (tile_map), for `rows`-row tiles of `group` heads a token."""

    query_start: jax.Array
    num_seqs: jax.Array
    rows: int
    group: int
    num_tiles: int
    seq: jax.Array
    first: jax.Array

    @classmethod
    def of(cls, num_tokens: int, query_start: jax.Array, num_seqs: jax.Array, rows: int, group: int):
        num_tiles = pl.cdiv(num_tokens, rows // group) + query_start.shape[0] - 1
        seq, first = tile_map(query_start, num_seqs, rows // group, num_tiles)
        return cls(query_start, num_seqs, rows, group, num_tiles, seq, first)

    @property
    def tile_tokens(self) -> int:
        return self.rows // self.group

    def lay_out(self, q: jax.Array) -> jax.Array:
        """q [T, Hq, D] as tiles [Hk, tiles, R, D]: row r of tile t holds token `first + r // G` of the tile's
        sequence, head `r % G` of the KV head's group; rows past the tile's tokens (or the sequence's) are zero."""
        num_tokens, num_q_heads, head_dim = q.shape
        row = jnp.arange(self.rows, dtype=jnp.int32)
        token_in_seq = self.first[:, None] + row // self.group  # [tiles, R]
        seq = jnp.maximum(self.seq, 0)[:, None]
        query_start = self.query_start
        row_live = (
            (self.seq[:, None] >= 0)
            & (row < self.tile_tokens * self.group)
            & (token_in_seq < query_start[seq + 1] - query_start[seq])
        )
        token = jnp.where(row_live, query_start[seq] + token_in_seq, 0)
        grouped = q.reshape(num_tokens, num_q_heads // self.group, self.group, head_dim)
        tiles = grouped[token, :, (row % self.group)[None, :]]  # [tiles, R, Hk, D]
        return jnp.where(row_live[..., None, None], tiles, 0).transpose(2, 0, 1, 3)

    def taken_apart(self, num_tokens: int, tiled: jax.Array) -> jax.Array:
        """[K, Hk, tiles, R, ...] back to [K, T, Hq, ...]: token tau of sequence s (position p in it) sits in tile
        `query_start[s] // tile_tokens + s + p // tile_tokens`, row `(p % tile_tokens) * G + g`. Rows of tokens past
        the last sequence (bucket padding) read some tile's row: the caller masks them."""
        tile_tokens, query_start = self.tile_tokens, self.query_start
        tokens = jnp.arange(num_tokens, dtype=jnp.int32)
        token_seq = jnp.searchsorted(query_start, tokens, side="right").astype(jnp.int32) - 1
        token_seq = jnp.clip(token_seq, 0, query_start.shape[0] - 2)
        position = tokens - query_start[token_seq]
        tile = query_start[token_seq] // tile_tokens + token_seq + position // tile_tokens
        tile = jnp.clip(tile, 0, self.num_tiles - 1)
        row = (position % tile_tokens)[:, None] * self.group + jnp.arange(self.group, dtype=jnp.int32)[
            None, :
        ]
        picked = jnp.moveaxis(tiled[:, :, tile[:, None], row], 1, 2)  # [K, T, Hk, G, ...]
        splits, _, num_kv_heads = picked.shape[:3]
        return picked.reshape(splits, num_tokens, num_kv_heads * self.group, *tiled.shape[4:])

    def live(self, num_tokens: int) -> jax.Array:
        """[T] bool: the tokens of live sequences (the rest is bucket padding)."""
        return jnp.arange(num_tokens, dtype=jnp.int32) < self.query_start[self.num_seqs[0]]
