"""Prometheus metrics with vLLM's names under a `jpaged:` prefix, in one registry per app.

Engine state (queue sizes, KV usage, token and cache counters) is read from `engine.metrics()` at scrape time by
a custom collector, so the engine keeps no Prometheus objects; request latencies are observed by the server as
outputs stream past.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from jpaged.engine.async_engine import AsyncLLMEngine
from jpaged.engine.engine_metrics import ExpertLoad
from jpaged.outputs import RequestOutput

if TYPE_CHECKING:
    from jpaged.engine.lora_adapters import LoRAStats
    from jpaged.engine.speculation import SpecDecodeStats

# vLLM's buckets, so dashboards built for vLLM read these unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

_GAUGES = {
    "num_requests_running": "Requests with sequences in the running batch.",
    "num_requests_waiting": "Requests waiting (or swapped out) for a place in the batch.",
    "kv_cache_usage_perc": "Fraction of KV cache blocks in use (1 = full).",
    "warmup_programs_remaining": "Step programs a progressive warm-up still compiles in the background "
    "(steps stay smaller until they land; 0: every step shape is ready).",
}
_COUNTERS = {  # exported name -> (engine.metrics() key, help)
    "num_preemptions": ("num_preemptions", "Sequences preempted to free KV blocks."),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "prompt_tokens": ("prompt_tokens", "Prompt tokens processed."),
    "generation_tokens": ("generation_tokens", "Tokens generated."),
    "num_compilations": (
        "num_compilations",
        "Device step programs compiled or loaded, warm-up's included (a progressive warm-up's grow after ready).",
    ),
    "num_live_compilations": (
        "num_live_compilations",
        "Device step programs compiled while a step waited for them: live requests paid each (0 with warm-up).",
    ),
}


class EngineCollector:
    """Reads the engine's counters and gauges at scrape time."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self._engine = engine
        self._model_name = model_name

    def collect(self):
        values = self._engine.metrics()
        for name, doc in _GAUGES.items():
            family = GaugeMetricFamily(f"jpaged:{name}", doc, labels=["model_name"])
            family.add_metric([self._model_name], float(values[name]))
            yield family
        for name, (key, doc) in _COUNTERS.items():
            family = CounterMetricFamily(f"jpaged:{name}", doc, labels=["model_name"])
            family.add_metric([self._model_name], float(values[key]))
            yield family
        load = self._engine.expert_load()
        if load is not None:
            yield expert_load_family(load, self._model_name)
        if self._engine.engine.config.enable_lora:
            yield from lora_families(self._engine.lora_stats(), self._model_name)
        spec = self._engine.spec_decode_stats()
        if spec is not None:
            yield from spec_decode_families(spec, self._model_name)


def spec_decode_families(stats: SpecDecodeStats, model_name: str) -> Iterator[Metric]:
    """Speculative decoding's counters, as vLLM names them: the acceptance rate is accepted over draft tokens,
    and the accepted tokens by position say how far proposals stay right."""
    for key, doc in (
        ("spec_decode_num_drafts", "Verifications of proposed tokens (a sequence's step with proposals)."),
        ("spec_decode_num_draft_tokens", "Proposed tokens verified."),
        ("spec_decode_num_accepted_tokens", "Proposed tokens accepted."),
    ):
        family = CounterMetricFamily(f"jpaged:{key}", doc, labels=["model_name"])
        family.add_metric([model_name], float(stats.counters()[key]))
        yield family
    family = CounterMetricFamily(
        "jpaged:spec_decode_num_accepted_tokens_per_pos",
        "Proposed tokens accepted at each position of a proposal (0 first).",
        labels=["model_name", "position"],
    )
    for position, count in enumerate(stats.accepted_per_position):
        family.add_metric([model_name, str(position)], float(count))
    yield family


def lora_families(stats: LoRAStats, model_name: str) -> Iterator[Metric]:
    """The engine's LoRA device slots: how many running requests hold, how many hold an adapter, of how many,
    and how often one was written (loads growing with steady traffic: --max-loras is too small for it)."""
    for name, value, doc in (
        ("lora_slots_in_use", stats.slots_in_use, "LoRA device slots that running requests hold."),
        ("lora_slots_filled", stats.slots_filled, "LoRA device slots holding an adapter, in use or idle."),
        ("lora_slots", stats.max_loras, "LoRA device slots (--max-loras)."),
    ):
        family = GaugeMetricFamily(f"jpaged:{name}", doc, labels=["model_name"])
        family.add_metric([model_name], float(value))
        yield family
    loads = CounterMetricFamily(
        "jpaged:lora_slot_loads",
        "Adapters written into a device slot (first loads and least-recently-used swaps).",
        labels=["model_name"],
    )
    loads.add_metric([model_name], float(stats.slot_loads))
    yield loads


def expert_load_family(load: ExpertLoad, model_name: str) -> HistogramMetricFamily:
    """A mixture of experts' load as a Prometheus histogram: one observation an expert of a layer a step, the
    tokens it took (an even load puts them all near tokens * top-k / experts)."""
    family = HistogramMetricFamily(
        "jpaged:moe_expert_tokens",
        "Tokens one expert of one layer took in one step (a mixture of experts' load balance).",
        labels=["model_name"],
    )
    cumulative = list(itertools.accumulate(load.counts))
    bounds = [*(str(float(b)) for b in load.buckets), "+Inf"]
    family.add_metric([model_name], list(zip(bounds, cumulative, strict=True)), float(load.total))
    return family


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))
        labels = ["model_name"]
        self.request_success = Counter(
            "jpaged:request_success",
            "Finished sequences by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.lora_requests = Counter(
            "jpaged:lora_requests",
            "Requests admitted per LoRA adapter (one per prompt).",
            ["model_name", "lora_name"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "jpaged:time_to_first_token_seconds",
            "From arrival to the first generated token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            "jpaged:inter_token_latency_seconds",
            "Between consecutive generated tokens of a request.",
            labels,
            buckets=ITL_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e_request_latency = Histogram(
            "jpaged:e2e_request_latency_seconds",
            "From arrival to the last token of a finished request.",
            labels,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class RequestTracker:
    """Latencies of one engine request, from the engine's own timestamps on its DELTA or FINAL_ONLY outputs.

    Every output carries only new tokens (parallel samples step together, so the longest choice counts). The
    tokens of one output share its time span evenly: a whole response's inter-token latency is its mean."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._last_token_time: float | None = None

    def observe(self, output: RequestOutput) -> None:
        new_tokens = max((len(c.token_ids) for c in output.outputs), default=0)
        times = output.metrics
        if new_tokens and "last_token_time" in times:
            since = self._last_token_time
            if since is None:
                self._metrics.time_to_first_token.observe(times["first_token_time"] - times["arrival_time"])
                since, new_tokens = times["first_token_time"], new_tokens - 1
            for _ in range(new_tokens):
                self._metrics.inter_token_latency.observe((times["last_token_time"] - since) / new_tokens)
            self._last_token_time = times["last_token_time"]
        for choice in output.outputs:  # a DELTA output holds a finished choice once, in the step it finished
            if choice.finish_reason is not None:
                self._metrics.request_success.labels(self._metrics.model_name, choice.finish_reason).inc()
        if output.finished and "last_token_time" in times:
            self._metrics.e2e_request_latency.observe(times["last_token_time"] - times["arrival_time"])
