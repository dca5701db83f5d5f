"""The sums behind sizing a deployment, from the token counts of a sample of real requests: how many KV blocks the
memory holds, how many requests fit at once at the sample's median, 95th percentile and at max_model_len, the
chance that a given number of concurrent requests needs more blocks than there are (preemption), and the
--max-model-len and --max-num-seqs the sample suggests. Each figure comes with the line of arithmetic behind it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jpaged.rounding import cdiv

MODEL_LEN_STEP = 256  # recommended max_model_len: the sample's longest request rounded up to this


@dataclass(frozen=True)
class Figure:
    name: str
    value: float | int
    arithmetic: str


@dataclass(frozen=True)
class CapacityPlan:
    figures: list[Figure]

    def __getitem__(self, name: str) -> float | int:
        return next(f.value for f in self.figures if f.name == name)

    def lines(self) -> list[str]:
        width = max(len(f.name) for f in self.figures)
        return [f"{f.name:<{width}}  {f.value:>10,}   {f.arithmetic}" for f in self.figures]


def preemption_risk(
    blocks_per_request: np.ndarray, concurrency: int, usable_blocks: int, rng: np.random.Generator, draws: int
) -> float:
    """The share of `draws` random sets of `concurrency` requests (drawn from the sample, with replacement)
    whose blocks at full length exceed the pool: each such moment preempts someone."""
    picks = rng.choice(blocks_per_request, size=(draws, concurrency))
    return float(np.mean(picks.sum(axis=1) > usable_blocks))


def capacity_plan(
    request_tokens: Sequence[int],
    *,
    num_blocks: int,
    block_size: int,
    bytes_per_token: int,
    max_model_len: int,
    concurrency: int,
    seed: int = 0,
    draws: int = 10_000,
) -> CapacityPlan:
    """`request_tokens`: each sampled request's prompt plus response tokens (what its sequence holds at its end);
    `num_blocks`: the pool's physical blocks (block 0 reserved) on each device; `bytes_per_token` per device."""
    if not request_tokens:
        raise ValueError("the traffic sample has no requests")
    tokens = np.asarray(request_tokens)
    usable = num_blocks - 1
    p50, p95 = (int(np.ceil(round(float(np.percentile(tokens, q)), 6))) for q in (50, 95))
    longest = int(tokens.max())
    per_block = block_size * bytes_per_token
    figures = [
        Figure("requests sampled", len(tokens), ""),
        Figure("tokens per request p50", p50, "prompt + response"),
        Figure("tokens per request p95", p95, ""),
        Figure("tokens per request max", longest, ""),
        Figure(
            "KV bytes per token", bytes_per_token, "2 (K, V) x layers x KV heads x head dim x dtype bytes"
        ),
        Figure("KV bytes per block", per_block, f"{block_size} tokens x {bytes_per_token}"),
        Figure("blocks available", usable, f"{num_blocks} in the pool - 1 reserved"),
    ]
    for name, length in (("p50", p50), ("p95", p95), ("max_model_len", max_model_len)):
        blocks = cdiv(length, block_size)
        figures.append(
            Figure(
                f"sequences that fit at {name}",
                usable // blocks,
                f"{usable} blocks // ceil({length} / {block_size}) = {blocks} blocks each",
            )
        )
    blocks_per_request = -(-tokens // block_size)
    risk = preemption_risk(blocks_per_request, concurrency, usable, np.random.default_rng(seed), draws)
    figures.append(
        Figure(
            f"preemption risk at {concurrency} concurrent",
            round(risk, 4),
            f"share of {draws} random sets of {concurrency} sampled requests needing > {usable} blocks",
        )
    )
    recommended_len = cdiv(longest, MODEL_LEN_STEP) * MODEL_LEN_STEP
    figures.append(
        Figure(
            "recommended --max-model-len",
            recommended_len,
            f"the longest request ({longest}) rounded up to a multiple of {MODEL_LEN_STEP}",
        )
    )
    p95_blocks = cdiv(p95, block_size)
    figures.append(
        Figure(
            "recommended --max-num-seqs",
            max(1, usable // p95_blocks),
            f"{usable} blocks // {p95_blocks} (a p95 request): that many p95 requests run without preemption",
        )
    )
    return CapacityPlan(figures)
