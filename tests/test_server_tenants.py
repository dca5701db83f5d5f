"""Tenant isolation in the prefix cache: requests with different `cache_salt` never share a block, so one tenant
cannot learn from another's hits whether a prompt was cached.

A timing probe measures how long a prompt takes to start; what makes it faster is the prompt tokens served from the
cache instead of computed. The test asserts on that cause, the engine's hit counter (the /metrics one), not on
wall-clock times, which on a shared CI machine would make it flaky; the times are shown in the run's summary."""

from __future__ import annotations

import time

import httpx
from figures import record

BLOCK = 16


def probe(http: httpx.Client, engine, prompt: list[int], salt: str | None) -> tuple[int, float]:
    """(prompt tokens served from the prefix cache, seconds to the whole 1-token answer) for one request."""
    hits = engine.metrics()["prefix_cache_hits"]
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    start = time.perf_counter()
    response = http.post("/v1/completions", json=body)
    seconds = time.perf_counter() - start
    assert response.status_code == 200, response.text
    return engine.metrics()["prefix_cache_hits"] - hits, seconds


def test_a_prompt_cached_for_one_tenant_is_no_hit_for_another(http, engine):
    victim = [(7 * i) % 40000 + 100 for i in range(6 * BLOCK + 3)]  # six full blocks and a partial one
    cold = [(11 * i) % 40000 + 101 for i in range(len(victim))]  # never sent before: the probe's baseline
    assert probe(http, engine, victim, "tenant-a")[0] == 0  # the victim's request fills the cache
    own_hits, own_time = probe(http, engine, victim, "tenant-a")
    other_hits, other_time = probe(http, engine, victim, "tenant-b")
    unsalted_hits, unsalted_time = probe(http, engine, victim, None)
    cold_hits, cold_time = probe(http, engine, cold, "tenant-b")
    record(
        "tenant isolation (tests/test_server_tenants.py)",
        f"prompt of {len(victim)} tokens; prefix-cache hit tokens / seconds to answer: same tenant {own_hits} / "
        f"{own_time:.4f}, other tenant {other_hits} / {other_time:.4f}, no salt {unsalted_hits} / "
        f"{unsalted_time:.4f}, never-seen prompt {cold_hits} / {cold_time:.4f}",
    )
    assert (
        own_hits == 6 * BLOCK
    )  # the probe would see a hit: every full block (the last token is always computed)
    # Another tenant computes every token, exactly as for a prompt nobody sent: nothing for its timing to tell.
    assert other_hits == unsalted_hits == cold_hits == 0


def test_tenants_sharing_a_salt_share_blocks_and_others_keep_their_own(http, engine):
    prompt = [(13 * i) % 40000 + 102 for i in range(3 * BLOCK + 1)]
    assert probe(http, engine, prompt, "team-x")[0] == 0
    assert probe(http, engine, prompt, "team-y")[0] == 0  # its own copy of the blocks, filled now
    assert probe(http, engine, prompt, "team-x")[0] == 3 * BLOCK
    assert probe(http, engine, prompt, "team-y")[0] == 3 * BLOCK
    assert probe(http, engine, prompt, "team-z")[0] == 0
