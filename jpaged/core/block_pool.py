"""The physical KV block pool: free blocks, refcounts, and the prefix-cache hash map.

A block is in exactly one of three states:
  * free        refcount 0, no hash, on the free stack;
  * evictable   refcount 0, keeps its hash, on the LRU (still hittable by later requests);
  * referenced  refcount >= 1, held by that many block tables.
Allocation takes a free block first and evicts the least recently freed cached block only when none is left,
so cached prefixes survive as long as memory allows. All operations are O(1).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

NULL_BLOCK = 0  # padding writes here; never handed out

BlockHash = bytes


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> BlockHash:
    """sha256 of (parent hash, token ids, extra keys) in a fixed binary encoding.

    Python's `hash()` is salted per process and collides easily, so it would make cache hits unreproducible and
    unsafe across tenants; a length-prefixed encoding keeps (1, 23) and (12, 3) apart.
    """
    digest = hashlib.sha256()
    digest.update(parent_hash if parent_hash is not None else b"\0" * 32)
    digest.update(struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids))
    for key in extra_keys:
        encoded = key.encode("utf-8")
        digest.update(struct.pack("<Q", len(encoded)))
        digest.update(encoded)
    return digest.digest()


class BlockPool:
    """`num_blocks` physical blocks (block 0 reserved), with refcounts and the hash -> block map."""

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an int >= 2 (block 0 is the null block), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        self._refcounts = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._hash_to_block: dict[BlockHash, int] = {}
        # Reversed so that blocks are handed out in ascending order, which keeps tests readable.
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first

    @property
    def num_free_blocks(self) -> int:
        """Blocks that `allocate` can hand out now: free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._block_hash[block_id]

    def evictable_blocks(self) -> list[int]:
        """Evictable cached blocks, least recently freed (next to be evicted) first."""
        return list(self._evictable)

    def free_blocks(self) -> list[int]:
        return list(self._free)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._hash_to_block.get(block_hash)

    def allocate(self) -> int:
        """Hand out one block with refcount 1 and no hash, evicting the LRU cached block if nothing is free."""
        if self._free:
            block_id = self._free.pop()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._forget_hash(block_id)
        else:
            raise RuntimeError("block pool exhausted: check num_free_blocks before allocating")
        self._refcounts[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        """Take one more reference; a cached block that was evictable stops being evictable."""
        if self._refcounts[block_id] == 0:
            if block_id not in self._evictable:
                raise ValueError(f"block {block_id} is free: only cached blocks can be re-referenced")
            del self._evictable[block_id]
        self._refcounts[block_id] += 1

    def decref(self, block_id: int) -> None:
        """Drop one reference; at zero a hashed block becomes evictable (most recent), others free."""
        if self._refcounts[block_id] <= 0:
            raise ValueError(f"block {block_id} has no references to drop")
        self._refcounts[block_id] -= 1
        if self._refcounts[block_id] == 0:
            if self._block_hash[block_id] is None:
                self._free.append(block_id)
            else:
                self._evictable[block_id] = None

    def register(self, block_id: int, block_hash: BlockHash) -> None:
        """Make a full, computed block hittable. A hash that another block already holds keeps that block,
        and a block that already has a hash keeps it: the first copy of a content stays the cached one."""
        if self._refcounts[block_id] == 0:
            raise ValueError(f"block {block_id} is not referenced: only live blocks can be registered")
        if block_hash in self._hash_to_block or self._block_hash[block_id] is not None:
            return
        self._block_hash[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id

    def drop_unreferenced_hashes(self) -> None:
        """Turn every evictable cached block into a plain free block."""
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._forget_hash(block_id)
            self._free.append(block_id)

    def _forget_hash(self, block_id: int) -> None:
        block_hash = self._block_hash[block_id]
        if block_hash is not None:
            del self._hash_to_block[block_hash]
            self._block_hash[block_id] = None
