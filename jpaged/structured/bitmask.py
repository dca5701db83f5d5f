"""Token bitmasks as the engine ships them to the device: int32 words, bit j of word i allows token 32*i + j.

This is llguidance's and xgrammar's layout (and vLLM's), so a backend fills the rows directly without a copy.
"""

from __future__ import annotations

import numpy as np


def num_words(vocab_size: int) -> int:
    """Words in one row of a bitmask over `vocab_size` tokens: ceil(V / 32)."""
    return (vocab_size + 31) // 32


def allocate_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """An int32 [num_rows, ceil(V / 32)] bitmask with every token allowed (-1 is all 32 bits set)."""
    return np.full((num_rows, num_words(vocab_size)), -1, dtype=np.int32)


def allowed_tokens(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """One bitmask row unpacked to bool[vocab_size]: True where the token is allowed."""
    row = np.ascontiguousarray(row, dtype=np.int32)
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)
