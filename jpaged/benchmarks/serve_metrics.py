"""The figures of a serving benchmark, from what the client saw of each request, with `vllm bench serve`'s
definitions so the two can be compared: TTFT (first streamed chunk), TPOT (the rest of the request's time over its
output tokens after the first), ITL (the gaps between streamed chunks, every request's together) and end-to-end
latency, as mean, median, standard deviation and chosen percentiles (NumPy's linear interpolation); throughputs over
the benchmark's wall time; goodput, the requests per second that met every SLO given (a request of one output token
has TPOT 0 there)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jpaged.benchmarks.spec_decode_counts import SpecDecodeCounts

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class RequestTiming:
    """One request as the client saw it; times in seconds from its send."""

    success: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    itl: tuple[float, ...] = ()  # gaps between consecutive streamed chunks
    latency: float = 0.0  # until the last chunk

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Distribution:
    """Milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]

    @classmethod
    def of(cls, seconds: Sequence[float], percentiles: Sequence[float]) -> Distribution:
        ms = np.asarray(seconds, np.float64) * 1e3 if len(seconds) else np.zeros(1)
        points = {float(p): float(np.percentile(ms, p)) for p in percentiles}
        return cls(float(np.mean(ms)), float(np.median(ms)), float(np.std(ms)), points)


@dataclass(frozen=True)
class ServeMetrics:
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None  # None without SLOs
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    spec_decode: SpecDecodeCounts | None = (
        None  # the server's speculative decoding over the run, where it speculates
    )


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """`--goodput ttft:500 tpot:50` as {"ttft": 500.0, "tpot": 50.0} (milliseconds); ValueError naming the bad
    part."""
    slos = {}
    for spec in specs:
        name, _, value = spec.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(f"goodput: {name!r} is not one of {', '.join(SLO_METRICS)} (as in ttft:500)")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput: {spec!r} needs a number of milliseconds after the colon") from None
        if slos[name] <= 0:
            raise ValueError(f"goodput: the {name} SLO must be > 0 ms, got {value}")
    return slos


def serve_metrics(
    requests: Sequence[RequestTiming],
    duration_s: float,
    percentiles: Sequence[float] = (99.0,),
    goodput: dict[str, float] | None = None,
) -> ServeMetrics:
    """The benchmark's figures; `goodput` maps SLO names (SLO_METRICS) to milliseconds."""
    done = [r for r in requests if r.success]
    total_input = sum(r.prompt_tokens for r in done)
    total_output = sum(r.output_tokens for r in done)
    request_goodput = None
    if goodput:
        seconds = {name: limit / 1e3 for name, limit in goodput.items()}

        def good(r: RequestTiming) -> bool:
            measured = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
            return all(measured[name] <= limit for name, limit in seconds.items())

        request_goodput = sum(map(good, done)) / duration_s
    return ServeMetrics(
        completed=len(done),
        failed=len(requests) - len(done),
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        duration_s=duration_s,
        request_throughput=len(done) / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        request_goodput=request_goodput,
        ttft=Distribution.of([r.ttft for r in done], percentiles),
        tpot=Distribution.of([r.tpot for r in done if r.tpot is not None], percentiles),
        itl=Distribution.of([gap for r in done for gap in r.itl], percentiles),
        e2el=Distribution.of([r.latency for r in done], percentiles),
    )
