"""KV blocks moved outside the device step: to and from host memory for swap preemption."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class BlockIO(Protocol):
    """Reads and writes whole blocks of the device pool, every layer (the model runner)."""

    def read_blocks(self, block_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]: ...

    def write_blocks(self, block_ids: Sequence[int], k: np.ndarray, v: np.ndarray) -> None: ...


class HostSwapSpace:
    """Host memory for swapped-out blocks: K and V [L, slots, B, Hk, D], a slot per block the block manager
    swaps out."""

    def __init__(self, shape: tuple[int, ...], dtype) -> None:
        self.k, self.v = np.zeros(shape, dtype), np.zeros(shape, dtype)

    def transfer(
        self, device: BlockIO, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]]
    ) -> None:
        """Device blocks to host slots (swap_out: (block, slot)) and host slots to device blocks (swap_in:
        (slot, block)), every read before any write (the block manager's contract: a slot or block freed by one
        may be reused by the other in the same step)."""
        incoming = [(self.k[:, slot].copy(), self.v[:, slot].copy(), block) for slot, block in swap_in]
        if swap_out:
            k, v = device.read_blocks([block for block, _ in swap_out])
            for i, (_, slot) in enumerate(swap_out):
                self.k[:, slot], self.v[:, slot] = k[:, i], v[:, i]
        if incoming:
            k = np.stack([k for k, _, _ in incoming], axis=1)
            v = np.stack([v for _, v, _ in incoming], axis=1)
            device.write_blocks([block for _, _, block in incoming], k, v)
