"""The (T tokens, S sequences) shapes the device step is compiled for, and which one a step pads up to.

Decode steps (one token per sequence, T = number of sequences) are most of a busy engine's steps, and padding them
is paid in every matmul. So steps of up to `max_num_seqs` tokens use T = S on a ladder of powers of two and the
midpoints between them from 16 (4, 8, 16, 24, 32, 48, 64, ...): a decode beyond 16 pads at most a third, not up to
a half. A step of at most 8 sequences keeps S = 8, so a lone request pays no padded attention rows, and T as small
as 4: the matrix kernels skip padded rows, but XLA's own ops (norms, SiLU, RoPE, residuals) do not, and over 16
padded rows they cost a lone request's bfloat16 decode step ~8% (README). Bigger steps (prefill chunks) use
powers of two for both, the largest being the configured limits themselves.
"""

from __future__ import annotations

import dataclasses

MIN_TOKENS = 4
MIDPOINTS_FROM = 16
MIN_SEQS = 8


def ladder(smallest: int, largest: int, *, midpoints: bool) -> tuple[int, ...]:
    """smallest, 2 * smallest, ... (with 1.5x points between from MIDPOINTS_FROM when `midpoints`), then `largest`
    itself."""
    sizes, size = [], min(smallest, largest)
    while size < largest:
        sizes.append(size)
        if midpoints and size >= MIDPOINTS_FROM and size + size // 2 < largest:
            sizes.append(size + size // 2)
        size *= 2
    return (*sizes, largest)


def _smallest_at_least(sizes: tuple[int, ...], size: int) -> int:
    for candidate in sizes:
        if candidate >= size:
            return candidate
    raise ValueError(f"{size} exceeds the largest step size {sizes[-1]}")


@dataclasses.dataclass(frozen=True)
class StepShapes:
    max_num_batched_tokens: int
    max_num_seqs: int

    def __post_init__(self) -> None:
        small = ladder(MIN_TOKENS, self.max_num_seqs, midpoints=True)
        small = tuple(t for t in small if t >= min(MIN_TOKENS, self.max_num_batched_tokens))
        big = ladder(MIN_TOKENS, self.max_num_batched_tokens, midpoints=False)
        tokens = sorted(
            {*(t for t in small if t <= self.max_num_seqs), *(t for t in big if t > self.max_num_seqs)}
        )
        object.__setattr__(self, "token_sizes", tuple(tokens))
        object.__setattr__(self, "seq_sizes", ladder(MIN_SEQS, self.max_num_seqs, midpoints=False))

    @property
    def min_seqs(self) -> int:
        return self.seq_sizes[0]

    @property
    def copy_sizes(self) -> tuple[int, ...]:
        """Row counts of the copy-on-write programs (powers of two, then max_num_seqs), each compiled at warm-up."""
        return (*(2**i for i in range((self.max_num_seqs - 1).bit_length())), self.max_num_seqs)

    def shape_for(self, num_tokens: int, num_rows: int) -> tuple[int, int]:
        """The compiled (T, S) a step of `num_tokens` tokens and `num_rows` sequence rows pads up to (rows can
        outnumber tokens when a prompt's last chunk forks into parallel samples)."""
        if num_rows > self.max_num_seqs:
            raise ValueError(f"{num_rows} sequence rows exceed max_num_seqs {self.max_num_seqs}")
        tokens = _smallest_at_least(self.token_sizes, max(num_tokens, 1))
        if tokens > self.max_num_seqs:
            return tokens, _smallest_at_least(self.seq_sizes, max(num_rows, 1))
        tokens = _smallest_at_least(self.token_sizes, max(num_tokens, num_rows))
        return tokens, self.min_seqs if num_rows <= self.min_seqs else tokens

    def all_shapes(self) -> list[tuple[int, int]]:
        """Every (T, S) that `shape_for` can answer: what warm-up compiles."""
        shapes = []
        for tokens in self.token_sizes:
            if tokens <= self.max_num_seqs:
                shapes += sorted({(tokens, self.min_seqs), (tokens, max(tokens, self.min_seqs))})
            else:
                shapes += [(tokens, seqs) for seqs in self.seq_sizes]
        return shapes
