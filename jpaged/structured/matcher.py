"""One request's grammar state: which tokens may come next, and the tokens it has taken.

The engine's contract, per constrained row of a step:
  1. before the step, `fill_bitmask(out)` writes the row of allowed tokens (or `fill_bitmasks` fills many rows
     in one call that releases the GIL);
  2. after sampling, `accept_token(token_id)` advances the state; False means the token broke the grammar (the
     mask was not applied): the matcher is then in an error state for good, and its mask allows only EOS;
  3. `is_terminated()` is True once the grammar is complete and only EOS may follow (or after an error).
A matcher is not thread-safe: one thread drives it at a time. Distinct matchers may be driven concurrently.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import llguidance
import llguidance.numpy
import numpy as np

from jpaged.structured.bitmask import num_words


class GrammarMatcher:
    """A llguidance matcher over the model's vocabulary (tokens beyond the tokenizer's are never allowed)."""

    __slots__ = ("_matcher", "vocab_size")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the allowed next tokens into `out`, a C-contiguous int32 row of ceil(V / 32) words."""
        _check_row(out, self.vocab_size)
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def accept_token(self, token_id: int) -> bool:
        """Advance past the sampled token; False (and an error state) if the grammar does not allow it."""
        return self._matcher.consume_token(int(token_id))

    def is_terminated(self) -> bool:
        """The grammar is complete (only EOS may follow), or the matcher is in an error state."""
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """The text so far is a whole match: the request may end here (EOS is allowed)."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the matcher is in its error state, or None."""
        return self._matcher.get_error() if self._matcher.is_error() else None

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative or async steps whose tokens are dropped)."""
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._matcher.get_error()}")

    def fork(self) -> GrammarMatcher:
        """An independent copy in the same state: each of n parallel samples (or a beam's children) gets one."""
        return GrammarMatcher(self._matcher.deep_copy(), self.vocab_size)


def fill_bitmasks(rows: Sequence[tuple[GrammarMatcher, int]], out: np.ndarray) -> None:
    """Fill row `index` of the int32 [S, ceil(V / 32)] `out` for every (matcher, index), in parallel threads
    outside the GIL; rows not named are left as they are."""
    if not rows:
        return
    vocab_size = rows[0][0].vocab_size
    if out.dtype != np.int32 or out.ndim != 2 or out.shape[1] != num_words(vocab_size):
        raise ValueError(f"out must be int32 [S, {num_words(vocab_size)}], got {out.dtype} {out.shape}")
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    for _, index in rows:
        if not 0 <= index < out.shape[0]:
            raise ValueError(f"row index {index} is outside the bitmask's {out.shape[0]} rows")
    pairs = [(matcher._matcher, index) for matcher, index in rows]
    llguidance.numpy.fill_next_token_bitmask_par(_executor(), pairs, out)


@functools.cache
def _executor() -> llguidance.LLExecutor:
    """llguidance's thread pool for parallel mask fills: one per process, made on first use."""
    return llguidance.LLExecutor()


def _check_row(out: np.ndarray, vocab_size: int) -> None:
    words = num_words(vocab_size)
    if out.dtype != np.int32 or out.shape != (words,) or not out.flags.c_contiguous:
        raise ValueError(
            f"out must be a C-contiguous int32 row of {words} words, got {out.dtype} {out.shape}"
        )
