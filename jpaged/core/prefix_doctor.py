"""The prefix-sharing doctor: finds requests that share a long body but differ at the very start (a timestamp,
request id or user name written before a shared system prompt), which the prefix cache cannot reuse: it matches
whole blocks from the first token only. It reports how many prompt tokens a request that placement keeps out of
the cache, and says nothing about traffic whose shared part already comes first.

Each request's reuse as placed is its longest common prefix with any other request (its neighbours in sorted
order); the shared body is the longest common run of tokens starting within the first `head` tokens of both
requests, found from `anchor`-token windows, each offset between two requests compared once per run. The host
core's: `jpaged plan` runs it on a traffic sample, the engine once on its first requests (PrefixHint)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

SAMPLE = 32  # the first requests an engine diagnoses, once
HEAD = 64  # how far into a request a shared body may start and still count as "behind a varying head"
ANCHOR = 8  # tokens a shared run must start with to be looked for


@dataclass(frozen=True)
class PrefixFinding:
    affected: int  # requests whose shared body starts after a varying head
    total: int
    lost_tokens: float  # mean prompt tokens per affected request kept out of the prefix cache (whole blocks)
    head_tokens: float  # mean length of the varying head in those requests
    example: int  # the index of one affected request

    def advice(self, example: str | None = None) -> str:
        """`example` names the example request (default: its index)."""
        return (
            f"{self.affected} of {self.total} requests share a body of prompt tokens that starts after a varying "
            f"head of about {self.head_tokens:.0f} tokens (request {example or self.example}, for one): the "
            "prefix cache, "
            f"which matches from the first token, misses about {self.lost_tokens:.0f} prompt tokens of each. "
            "Move the varying part (a timestamp, request id or name) after the shared part."
        )


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _whole_blocks(tokens: int, block_size: int) -> int:
    return tokens // block_size * block_size


def diagnose(prompts: Sequence[Sequence[int]], block_size: int = 16) -> PrefixFinding | None:
    """A finding when some requests lose at least two blocks each to a varying head; None otherwise."""
    prompts = [np.asarray(p, np.int64) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: prompts[i].tolist())
    reuse = [0] * len(prompts)
    for before, after in itertools.pairwise(order):
        shared = _common(prompts[before], prompts[after])
        reuse[before], reuse[after] = max(reuse[before], shared), max(reuse[after], shared)
    windows: dict[bytes, list[tuple[int, int]]] = {}
    for i, tokens in enumerate(prompts):
        for start in range(min(HEAD, len(tokens) - ANCHOR + 1)):
            windows.setdefault(tokens[start : start + ANCHOR].tobytes(), []).append((i, start))
    affected = []
    for i, tokens in enumerate(prompts):
        best, head = 0, 0
        run_ends: dict[
            tuple[int, int], int
        ] = {}  # (other request, offset): where the last run compared ended
        for start in range(min(HEAD, len(tokens) - ANCHOR + 1)):
            for j, other_start in windows.get(tokens[start : start + ANCHOR].tobytes(), ()):
                diagonal = (j, other_start - start)
                if j == i or not (start or other_start) or start < run_ends.get(diagonal, 0):
                    continue  # itself, the common prefix, or inside a run already measured
                run = _common(tokens[start:], prompts[j][other_start:])
                run_ends[diagonal] = start + run
                if run > best:
                    best, head = run, start
        # Moved first, the body would be a shared prefix; as placed, only the common prefix is.
        lost = _whole_blocks(best, block_size) - _whole_blocks(reuse[i], block_size)
        if lost >= 2 * block_size:
            affected.append((i, lost, head))
    if not affected:
        return None
    return PrefixFinding(
        affected=len(affected),
        total=len(prompts),
        lost_tokens=sum(lost for _, lost, _ in affected) / len(affected),
        head_tokens=sum(head for _, _, head in affected) / len(affected),
        example=affected[0][0],
    )


@dataclass(slots=True)
class PrefixHint:
    """The doctor run once by an engine, on the first SAMPLE prompts it is given: the one-time log hint."""

    block_size: int
    sample: dict[str, list[int]] = field(default_factory=dict)  # request id -> prompt token ids
    done: bool = False

    def observe(self, request_id: str, token_ids: Sequence[int]) -> str | None:
        """The advice, once, when this prompt completes the sample and the sample has a finding; else None."""
        if self.done:
            return None
        self.sample[request_id] = list(token_ids)
        if len(self.sample) < SAMPLE:
            return None
        self.done = True
        sample, self.sample = self.sample, {}
        finding = diagnose(list(sample.values()), self.block_size)
        return finding.advice(example=list(sample)[finding.example]) if finding else None
