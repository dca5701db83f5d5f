"""The client side of `jpaged bench serve`: requests sent to any OpenAI-compatible server (jpaged or vLLM) as
streamed completions, arriving as a Poisson process at a chosen rate (or all at once) under a concurrency cap, each
one's chunks timed as they arrive (serve_metrics.RequestTiming)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

import httpx
import numpy as np
from tqdm.auto import tqdm

from jpaged.benchmarks.datasets import BenchRequest
from jpaged.benchmarks.serve_metrics import RequestTiming


def arrival_times(num_requests: int, request_rate: float, rng: np.random.Generator, burstiness: float = 1.0):
    """Seconds from the start at which each request is sent: all at 0 for an infinite rate, else gamma-distributed
    gaps (exponential, a Poisson process, at burstiness 1) scaled so the last one lands at N / rate, as vllm bench
    serve does (the sum of random gaps would otherwise miss it by a few percent)."""
    if request_rate == float("inf"):
        return np.zeros(num_requests)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    times = np.cumsum(gaps)
    return times * (num_requests / request_rate / times[-1])


async def stream_completion(
    client: httpx.AsyncClient, url: str, body: dict, request: BenchRequest
) -> RequestTiming:
    """One streamed completion, timed: TTFT at the first chunk, a gap per later chunk (the usage-only chunk
    aside)."""
    start = time.perf_counter()
    chunk_times, usage = [], None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return RequestTiming(False, request.prompt_tokens)
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    return RequestTiming(False, request.prompt_tokens)
                if event.get("choices"):  # as vllm bench serve: any chunk of choices, text or not yet
                    chunk_times.append(time.perf_counter() - start)
                usage = event.get("usage") or usage
    except httpx.HTTPError:
        return RequestTiming(False, request.prompt_tokens)
    if not chunk_times:
        return RequestTiming(False, request.prompt_tokens)
    prompt_tokens = usage["prompt_tokens"] if usage else request.prompt_tokens
    output_tokens = usage["completion_tokens"] if usage else len(chunk_times)
    gaps = tuple(np.diff(chunk_times).tolist())
    return RequestTiming(True, prompt_tokens, output_tokens, chunk_times[0], gaps, chunk_times[-1])


async def run_requests(
    base_url: str,
    model: str | None,
    requests: Sequence[BenchRequest],
    *,
    request_rate: float = float("inf"),
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    ignore_eos: bool = False,
    seed: int = 0,
    progress: bool = True,
) -> tuple[list[RequestTiming], float]:
    """Every request's timing (in the order given) and the wall time from the first send to the last reply."""
    url = base_url.rstrip("/") + "/v1/completions"
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    sends = arrival_times(len(requests), request_rate, np.random.default_rng(seed), burstiness)
    bar = tqdm(total=len(requests), desc="requests", disable=not progress)

    async def one(client: httpx.AsyncClient, request: BenchRequest, at: float, start: float) -> RequestTiming:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        body = {
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": ignore_eos,
        }
        if model is not None:
            body["model"] = model
        async with limit:
            timing = await stream_completion(client, url, body, request)
        bar.update(1)
        return timing

    timeout = httpx.Timeout(None, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()
        timings = await asyncio.gather(
            *(one(client, r, at, start) for r, at in zip(requests, sends, strict=True))
        )
        duration = time.perf_counter() - start
    bar.close()
    return list(timings), duration
