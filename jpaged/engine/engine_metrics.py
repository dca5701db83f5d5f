"""The engine's gauges and counters as one flat dict, read on demand (LLMEngine.metrics, the server's /metrics).

Read from the state the scheduler and block manager keep anyway, so nothing is counted twice and the loop keeps no
metrics objects; its only counts of its own are the tokens (TokenCounts). Host-side: no JAX.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jpaged.core.block_manager import BlockManager
    from jpaged.core.scheduler import Scheduler


@dataclass(slots=True)
class ExpertLoad:
    """A mixture of experts' load summed over the steps so far, as the steps' histograms (runner/expert_load.py)
    come back: each (layer, expert) of a step one observation, the number of the step's tokens it took."""

    buckets: tuple[int, ...]  # the buckets' upper bounds; a last bucket past them (+Inf)
    counts: list[int] = field(
        default_factory=list
    )  # observations a bucket (not cumulative), len(buckets) + 1
    total: int = 0  # the observations' sum: (token, expert) pairs routed, over every layer

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.buckets) + 1)

    def add(self, step: Sequence[int]) -> None:
        """A step's histogram: its buckets' counts, then its sum."""
        *counts, total = (int(n) for n in step)
        self.counts = [a + b for a, b in zip(self.counts, counts, strict=True)]
        self.total += total


@dataclass(slots=True)
class TokenCounts:
    prompt_tokens: int = 0  # prompt tokens of the requests scheduled for their first token
    generation_tokens: int = 0  # sampled tokens, less those of sequences that ended while their step ran


@dataclass(frozen=True, slots=True)
class ProgramCounts:
    num_compilations: int  # step programs compiled or loaded, warm-up's included
    num_live_compilations: int  # of those, the ones a step waited for (live requests paid them)
    warmup_programs_remaining: int  # still compiling in a progressive warm-up's background


def engine_metrics(
    blocks: BlockManager, scheduler: Scheduler, tokens: TokenCounts, programs: ProgramCounts
) -> dict[str, float]:
    """vLLM's metric names (jpaged_server.metrics exports them under a `jpaged:` prefix)."""
    return {
        "num_requests_running": len({s.request.request_id for s in scheduler.running}),
        "num_requests_waiting": len({s.request.request_id for s in [*scheduler.waiting, *scheduler.swapped]}),
        "kv_cache_usage_perc": blocks.usage,
        "num_free_blocks": blocks.num_free_blocks,
        "num_total_blocks": blocks.num_total_blocks,
        "num_preemptions": scheduler.num_preemptions,
        "prefix_cache_queries": blocks.prefix_cache_queries,
        "prefix_cache_hits": blocks.prefix_cache_hits,
        "prompt_tokens": tokens.prompt_tokens,
        "generation_tokens": tokens.generation_tokens,
        "num_compilations": programs.num_compilations,
        "num_live_compilations": programs.num_live_compilations,
        "warmup_programs_remaining": programs.warmup_programs_remaining,
    }
