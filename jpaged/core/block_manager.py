"""Per-sequence block tables over the physical pool: prefix matching, copy-on-write, fork, swap.

Pure Python, no JAX: the scheduler calls it, the model runner reads block tables from it, and the engine executes
the device work it records (CoW copies, swap transfers) at the start of the next step. Every table is mirrored
as a row of one numpy array, rewritten only when the table changes, so a step gathers the tables of its
sequences in one indexing call instead of copying each list (vLLM's persistent block table).

Transfer contract for the engine: within one step, apply all transfers as if every read happens before any write
(gather swap-out blocks, swap-in host slots and CoW sources from the state the previous step left, then scatter).
The manager releases blocks and host slots as soon as it records a transfer, so within a step a released block can
be the destination of another transfer; reads-before-writes keeps that correct.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from jpaged.core.block_pool import BlockHash, BlockPool, hash_block_tokens
from jpaged.rounding import cdiv


@dataclass(slots=True)
class _SequenceBlocks:
    block_ids: list[int] = field(default_factory=list)  # device blocks, empty while swapped out
    # Hashes of the leading full, computed blocks, in order: the chain that the next block's hash extends.
    block_hashes: list[BlockHash] = field(default_factory=list)
    host_slots: list[int] | None = None  # set while swapped out
    row: int = -1  # its row in the table array


class _TableRows:
    """Rows of block ids (padded with the null block 0), one per registered sequence; widens as tables grow."""

    def __init__(self) -> None:
        self.array = np.zeros((64, 16), np.int32)
        self._free = list(range(63, -1, -1))

    def acquire(self) -> int:
        if not self._free:
            rows = len(self.array)
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        return self._free.pop()

    def release(self, row: int) -> None:
        self.array[row] = 0
        self._free.append(row)

    def write(self, row: int, block_ids: list[int]) -> None:
        width = self.array.shape[1]
        if len(block_ids) > width:
            wider = np.zeros((len(self.array), max(2 * width, len(block_ids))), np.int32)
            wider[:, :width] = self.array
            self.array = wider
        self.array[row, : len(block_ids)] = block_ids
        self.array[row, len(block_ids) :] = 0


class BlockManager:
    """Hands out KV blocks to sequences as they grow and shares full blocks between equal prefixes."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        num_swap_blocks: int = 0,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(num_swap_blocks, int) or num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be an int >= 0, got {num_swap_blocks!r}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_swap_blocks = num_swap_blocks
        self._free_host_slots = list(range(num_swap_blocks - 1, -1, -1))
        self._seqs: dict[int, _SequenceBlocks] = {}
        self._rows = _TableRows()
        self._pending_copies: list[tuple[int, int]] = []
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    @property
    def num_total_blocks(self) -> int:
        """Usable blocks: the null block is excluded."""
        return self.pool.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_free_host_slots(self) -> int:
        return len(self._free_host_slots)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by live sequences (evictable cached blocks count as free)."""
        return (self.num_total_blocks - self.num_free_blocks) / self.num_total_blocks

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._on_device(seq_id).block_ids)

    def block_tables(self, seq_ids: Sequence[int]) -> np.ndarray:
        """int32 [len(seq_ids), W]: row i is the table of seq_ids[i], padded with the null block 0 (W is at
        least the longest table of any sequence)."""
        seqs = self._seqs
        return self._rows.array[[seqs[seq_id].row for seq_id in seq_ids]]

    def match_prefix(self, seq_id: int, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Attach the longest run of cached leading full blocks and return how many tokens they hold.

        At most (len(token_ids) - 1) // block_size blocks are reused so the last prompt token is always computed
        (its logits are needed). Registers the sequence if it is new; it must hold no blocks yet. Returns 0 and
        counts nothing when caching is off. If the following allocate_slots fails, free the sequence: that
        returns the hit blocks to the evictable LRU.
        """
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = _SequenceBlocks(row=self._rows.acquire())
        elif seq.block_ids or seq.host_slots is not None:
            raise ValueError(
                f"seq_id {seq_id} already holds blocks: free it before matching its prefix again"
            )
        if not self.enable_prefix_caching or not token_ids:
            return 0
        max_blocks = (len(token_ids) - 1) // self.block_size
        parent: BlockHash | None = None
        for index in range(max_blocks):
            parent = self._hash_block(parent, token_ids, index, cache_salt)
            block_id = self.pool.lookup(parent)
            if block_id is None:
                break
            self.pool.incref(block_id)
            seq.block_ids.append(block_id)
            seq.block_hashes.append(parent)
        self._rows.write(seq.row, seq.block_ids)
        num_hit_tokens = len(seq.block_ids) * self.block_size
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += num_hit_tokens
        return num_hit_tokens

    def allocate_slots(self, seq_id: int, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """Cover positions [0, computed + new) with blocks; positions [computed, computed + new) are written
        this step, so any shared block among them is copied first. Returns False, changing nothing, when the
        pool (counting evictable cached blocks) is too small."""
        seq = self._seqs.get(seq_id)
        # Fast path, 15 of 16 decode steps: the token goes into the sequence's own partly-filled block (a swapped
        # out sequence has no blocks, so the length test fails for it).
        if (
            num_new_tokens == 1
            and num_computed_tokens % self.block_size
            and seq is not None
            and num_computed_tokens // self.block_size == len(seq.block_ids) - 1
            and self.pool.refcount(seq.block_ids[-1]) == 1
        ):
            return True
        seq = self._seq_to_allocate(seq_id, num_computed_tokens, num_new_tokens)
        block_ids, pool = seq.block_ids, self.pool
        num_blocks = cdiv(num_computed_tokens + num_new_tokens, self.block_size)
        num_needed = max(num_blocks - len(block_ids), 0)
        written = range(num_computed_tokens // self.block_size, min(len(block_ids), num_blocks))
        shared = [index for index in written if pool.refcount(block_ids[index]) > 1]
        if num_needed + len(shared) > pool.num_free_blocks:
            return False
        for index in shared:
            source = block_ids[index]
            block_ids[index] = pool.allocate()
            pool.decref(source)
            self._pending_copies.append((source, block_ids[index]))
        if num_needed:
            block_ids.extend(pool.allocate() for _ in range(num_needed))
        if seq.row < 0:
            seq.row = self._rows.acquire()
            self._seqs[seq_id] = seq
        self._rows.write(seq.row, block_ids)
        return True

    def cache_full_blocks(
        self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int, cache_salt: str | None = None
    ) -> None:
        """Make the sequence's full, computed blocks hittable by later requests."""
        seq = self._on_device(seq_id)
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(seq.block_ids))
        if len(token_ids) < num_full * self.block_size:
            raise ValueError(f"token_ids has {len(token_ids)} tokens, fewer than num_computed_tokens")
        for index in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            block_hash = self._hash_block(parent, token_ids, index, cache_salt)
            self.pool.register(seq.block_ids[index], block_hash)
            seq.block_hashes.append(block_hash)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent; the first write into a shared block copies it.

        Call between steps, never between the parent's allocate_slots and the forward pass that writes it."""
        if child_id in self._seqs:
            raise ValueError(f"child_id {child_id} already exists")
        parent = self._on_device(parent_id)
        for block_id in parent.block_ids:
            self.pool.incref(block_id)
        child = _SequenceBlocks(list(parent.block_ids), list(parent.block_hashes), row=self._rows.acquire())
        self._rows.write(child.row, child.block_ids)
        self._seqs[child_id] = child

    def free(self, seq_id: int) -> None:
        """Release a finished, aborted or recompute-preempted sequence; full blocks stay cached until evicted."""
        seq = self._get(seq_id)
        # Tail first, so a shared prefix's root outlives its branches in the LRU.
        for block_id in reversed(seq.block_ids):
            self.pool.decref(block_id)
        if seq.host_slots is not None:
            self._free_host_slots.extend(seq.host_slots)
        self._rows.release(seq.row)
        del self._seqs[seq_id]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(src, dst) device block copies recorded by copy-on-write since the last call."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def can_swap_out(self, seq_id: int) -> bool:
        seq = self._get(seq_id)
        return seq.host_slots is None and len(seq.block_ids) <= len(self._free_host_slots)

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        """Move a preempted sequence to host slots; returns (device_block, host_slot) and frees the blocks."""
        if not self.can_swap_out(seq_id):
            raise ValueError(f"seq_id {seq_id} cannot be swapped out: check can_swap_out first")
        seq = self._seqs[seq_id]
        # A block copied this step holds its source's content only after the copy runs; reads happen first.
        copied_from = {dst: src for src, dst in self._pending_copies}
        slots = [self._free_host_slots.pop() for _ in seq.block_ids]
        transfers = [
            (copied_from.get(block_id, block_id), slot)
            for block_id, slot in zip(seq.block_ids, slots, strict=True)
        ]
        for block_id in reversed(seq.block_ids):
            self.pool.decref(block_id)
        seq.block_ids, seq.host_slots = [], slots
        self._rows.write(seq.row, seq.block_ids)
        self.num_swapped_out_blocks += len(slots)
        return transfers

    def can_swap_in(self, seq_id: int) -> bool:
        seq = self._get(seq_id)
        return seq.host_slots is not None and len(seq.host_slots) <= self.pool.num_free_blocks

    def swap_in(self, seq_id: int) -> list[tuple[int, int]]:
        """Bring a swapped sequence back into fresh device blocks; returns (host_slot, device_block)."""
        if not self.can_swap_in(seq_id):
            raise ValueError(f"seq_id {seq_id} cannot be swapped in: check can_swap_in first")
        seq = self._seqs[seq_id]
        slots, seq.host_slots = seq.host_slots or [], None
        seq.block_ids = [self.pool.allocate() for _ in slots]
        self._rows.write(seq.row, seq.block_ids)
        if self.enable_prefix_caching:
            for block_id, block_hash in zip(seq.block_ids, seq.block_hashes, strict=False):
                self.pool.register(block_id, block_hash)
        self._free_host_slots.extend(reversed(slots))
        self.num_swapped_in_blocks += len(slots)
        return list(zip(slots, seq.block_ids, strict=True))

    def reset_prefix_cache(self) -> bool:
        """Forget the hashes of all unreferenced cached blocks (they become plain free blocks).

        Returns True when the cache is now empty, False when some hashed blocks are still held by live sequences:
        those stay hittable (their content is live) until a later reset after they are freed, or eviction.
        """
        self.pool.drop_unreferenced_hashes()
        return self.pool.num_cached_blocks == 0

    def _hash_block(
        self, parent: BlockHash | None, token_ids: Sequence[int], index: int, cache_salt: str | None
    ) -> BlockHash:
        tokens = token_ids[index * self.block_size : (index + 1) * self.block_size]
        # The salt enters only the first block: every later hash chains through it.
        extra_keys = (cache_salt,) if index == 0 and cache_salt is not None else ()
        return hash_block_tokens(parent, tokens, extra_keys)

    def _seq_to_allocate(self, seq_id: int, num_computed_tokens: int, num_new_tokens: int) -> _SequenceBlocks:
        """The sequence allocate_slots grows (a fresh one for an unknown id), after the checks that catch
        engine bugs."""
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError(
                f"num_computed_tokens and num_new_tokens must be >= 0, got {num_computed_tokens}, {num_new_tokens}"
            )
        seq = self._seqs.get(seq_id)
        if seq is None:
            if num_computed_tokens:
                raise KeyError(f"seq_id {seq_id} is unknown but claims {num_computed_tokens} computed tokens")
            return _SequenceBlocks()
        if seq.host_slots is not None:
            raise ValueError(f"seq_id {seq_id} is swapped out: swap it in before allocating")
        if num_computed_tokens > len(seq.block_ids) * self.block_size:
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} exceeds the {len(seq.block_ids)} blocks of seq {seq_id}"
            )
        if num_new_tokens and num_computed_tokens < len(seq.block_hashes) * self.block_size:
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} would overwrite cached full blocks of seq {seq_id}"
            )
        return seq

    def _get(self, seq_id: int) -> _SequenceBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"seq_id {seq_id} is not known to the block manager")
        return seq

    def _on_device(self, seq_id: int) -> _SequenceBlocks:
        seq = self._get(seq_id)
        if seq.host_slots is not None:
            raise ValueError(f"seq_id {seq_id} is swapped out: swap it in first")
        return seq
