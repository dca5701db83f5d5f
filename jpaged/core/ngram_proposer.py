"""N-gram proposals for speculative decoding (vLLM's `"method": "ngram"`, prompt lookup): the sequence's last n
tokens, for the longest n from `prompt_lookup_max` down to `prompt_lookup_min` that occurred earlier in its own
tokens, and the k tokens that followed that n-gram's most recent earlier occurrence. Host core: numpy only."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` proposed next tokens (fewer where the match is followed by fewer; none without a match)."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"prompt_lookup_min ({min_n}) must be >= 1 and <= prompt_lookup_max ({max_n})")
    tokens = np.asarray(token_ids, np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        # Windows that start before the suffix itself does: an occurrence with at least one token after it.
        windows = sliding_window_view(tokens[:-1], n)
        starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if starts.size:
            start = int(starts[-1]) + n
            return tokens[start : start + k].tolist()
    return []
