"""Load on loopback: hundreds of concurrent streamed completions of mixed lengths, a fraction cancelled mid-stream,
over a KV pool small enough that the scheduler must preempt (recompute, then swap). Afterwards every request not
cancelled has its solo greedy output, nothing runs or waits, no block is held, and three rounds leave the process's
memory where the second left it. The figures go to the run's summary (figures.py)."""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import random
import resource
import time

import httpx
import pytest
from figures import record
from greedy import NEAR_TIE
from jpaged_server.api_server import build_app
from server_harness import SMALL_ENGINE_ARGS, serve_in_thread, shared_engine

from jpaged.config import EngineConfig

NUM_REQUESTS = 300  # a round: all sent at once (under the admission cap: max_num_seqs + 512 waiting)
CANCEL_EVERY = 5  # every fifth request is cancelled after its first chunk
NUM_SHAPES = 24  # distinct (prompt, max_tokens) requests, each referenced once, solo
# 8 sequences of up to 4 + 60 prompt and 32 output tokens need up to 48 blocks of 16: 20 force preemption.
POOL = dict(SMALL_ENGINE_ARGS, num_blocks=20)


def shapes() -> list[dict]:
    rng = random.Random(23)
    return [
        {
            "prompt": [rng.randrange(1, 49152) for _ in range(rng.randrange(4, 61))],
            "max_tokens": rng.randrange(1, 33),
            "temperature": 0,
            "ignore_eos": True,
        }
        for _ in range(NUM_SHAPES)
    ]


def solo_references(base_url: str, bodies: list[dict]) -> list[dict]:
    """Each request alone, with the top-2 logprobs that tell a genuine near-tie from a wrong token."""
    references = []
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for body in bodies:
            response = client.post("/v1/completions", json={**body, "logprobs": 2})
            assert response.status_code == 200, response.text
            references.append(response.json()["choices"][0]["logprobs"])
    return references


def check_same_greedy(reference: dict, tokens: list[str], label: str) -> None:
    """tests/greedy.py's rule on the API's logprobs: equal tokens, or a divergence at a top-2 gap under NEAR_TIE."""
    for step, (expected, actual) in enumerate(zip(reference["tokens"], tokens, strict=False)):
        if expected != actual:
            top = sorted(reference["top_logprobs"][step].values(), reverse=True)[:2]
            assert top[0] - top[1] < NEAR_TIE, (
                f"{label}: diverged at step {step} ({expected!r} vs {actual!r})"
            )
            return
    assert tokens == reference["tokens"], f"{label}: same prefix, different lengths"


async def one_request(client: httpx.AsyncClient, body: dict, cancel: bool) -> tuple[str, int | list[str]]:
    """('cancelled', 0), ('served', the streamed tokens) or ('error', status)."""
    async with client.stream(
        "POST", "/v1/completions", json={**body, "stream": True, "logprobs": 0}
    ) as response:
        if response.status_code != 200:
            await response.aread()
            return "error", response.status_code
        tokens: list[str] = []
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                return "error", chunk["error"]["code"]
            for choice in chunk["choices"]:
                tokens += (choice.get("logprobs") or {}).get("tokens", [])
            if cancel:
                return "cancelled", 0  # leaving the block closes the connection mid-stream
        return "served", tokens


async def one_round(
    base_url: str, bodies: list[dict], references: list[dict], seed: int
) -> collections.Counter:
    rng = random.Random(seed)
    picks = [rng.randrange(len(bodies)) for _ in range(NUM_REQUESTS)]
    limits = httpx.Limits(max_connections=NUM_REQUESTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        results = await asyncio.gather(
            *(one_request(client, bodies[p], i % CANCEL_EVERY == 0) for i, p in enumerate(picks))
        )
    counts: collections.Counter = collections.Counter()
    for i, (pick, (outcome, detail)) in enumerate(zip(picks, results, strict=True)):
        if outcome == "served":
            check_same_greedy(references[pick], detail, f"request {i} (shape {pick})")
            assert len(detail) == bodies[pick]["max_tokens"]
        counts[outcome if outcome != "error" else f"error {detail}"] += 1
    return counts


def assert_idle(engine) -> dict:
    metrics = engine.metrics()
    assert metrics["num_requests_running"] == metrics["num_requests_waiting"] == 0, metrics
    assert metrics["kv_cache_usage_perc"] == 0, metrics
    assert metrics["num_free_blocks"] == metrics["num_total_blocks"], metrics  # cached blocks count as free
    return metrics


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_hundreds_of_streams_with_cancellations_and_preemption_keep_every_output(tiny_model_dir, mode):
    rounds = 3 if mode == "recompute" else 1  # memory is watched over three rounds once
    config = EngineConfig(
        model=str(tiny_model_dir("smollm2_tied")), **POOL, preemption_mode=mode, swap_space=0.01
    )
    engine = shared_engine(config)
    bodies = shapes()
    lines, memory = [], []
    with serve_in_thread(build_app(engine, "tiny", max_waiting_requests=512)) as running:
        references = solo_references(running.base_url, bodies)
        for round_index in range(rounds):
            before = engine.metrics()
            start = time.monotonic()
            counts = asyncio.run(one_round(running.base_url, bodies, references, seed=round_index))
            seconds = time.monotonic() - start
            # A cancelled stream's abort reaches the engine before its next step: wait for the engine to idle.
            deadline = time.monotonic() + 60
            while engine.num_unfinished and time.monotonic() < deadline:
                time.sleep(0.01)
            after = assert_idle(engine)
            gc.collect()
            memory.append((rss_bytes(), len(gc.get_objects())))
            preempted = after["num_preemptions"] - before["num_preemptions"]
            compiled = after["num_compilations"] - before["num_compilations"]
            errors = {k: v for k, v in counts.items() if k.startswith("error")}
            lines.append(
                f"{mode} round {round_index + 1}: {counts['served']} served, {counts['cancelled']} cancelled, "
                f"{preempted} preemptions, errors by status {errors or 'none'}, "
                f"{after['num_total_blocks'] - after['num_free_blocks']} blocks leaked, "
                f"{compiled} compilations, {seconds:.1f} s, RSS {memory[-1][0] / 2**20:.0f} MiB, "
                f"{memory[-1][1]} Python objects"
            )
            assert not errors, counts
            assert counts["served"] + counts["cancelled"] == NUM_REQUESTS
            assert preempted > 0, "the pool was meant to force preemption"
    record("load test (tests/test_server_load.py)", "\n".join(lines))
    if rounds == 3:
        # Round 1 warms caches (compiled shapes, tokenizer, allocator arenas); from round 2 to 3 nothing should grow
        # with the number of requests served: objects by less than one per request, memory by less than 32 MiB.
        (rss2, objects2), (rss3, objects3) = memory[1], memory[2]
        assert objects3 - objects2 < NUM_REQUESTS, memory
        assert rss3 - rss2 < 32 * 2**20, memory
