"""The prefix-sharing doctor flags traffic whose shared body sits behind a varying head (a timestamp before the
system prompt), with the prompt tokens that placement keeps out of the prefix cache, and stays quiet on traffic
whose shared part comes first; `jpaged plan` shows it beside the sizing, Thai costing several times English."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from jpaged.core.prefix_doctor import SAMPLE, PrefixHint, diagnose
from jpaged.entrypoints.cli import main

DATA = Path(__file__).resolve().parents[1] / "scripts" / "data"
BODY = list(range(1000, 1100))  # 100 shared tokens


def test_a_varying_head_before_a_shared_body_is_found_with_its_cost():
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(5, 900, 6)] + BODY + [2000 + i] for i in range(10)]
    finding = diagnose(prompts, block_size=16)
    assert finding is not None and (finding.affected, finding.total) == (10, 10)
    assert finding.lost_tokens == 96  # the body's 6 whole blocks, none of them reused as placed
    assert finding.head_tokens == 6
    assert "Move the varying part" in finding.advice()


def test_shared_parts_that_come_first_or_nothing_shared_are_quiet():
    rng = np.random.default_rng(1)
    well_formed = [BODY + [int(t) for t in rng.integers(5, 900, 20)] for _ in range(10)]
    unrelated = [[int(t) for t in rng.integers(5, 900, 120)] for _ in range(10)]
    assert diagnose(well_formed) is None and diagnose(unrelated) is None
    # A short shared run (one block) behind the head is not worth a warning.
    short = [[int(t) for t in rng.integers(5, 900, 6)] + BODY[:20] + [3000 + i] for i in range(10)]
    assert diagnose(short) is None


def test_the_engines_hint_diagnoses_its_first_requests_once_and_names_one():
    hint = PrefixHint(block_size=16)
    advice = [hint.observe(f"req-{i}", [7000 + i, 7100 + i] + BODY) for i in range(SAMPLE - 1)]
    assert advice == [None] * (SAMPLE - 1)  # nothing said before the sample is complete
    last = hint.observe("req-last", [9000, 9001] + BODY)
    assert last is not None and last.startswith(f"{SAMPLE} of {SAMPLE} requests") and "request req-0," in last
    assert hint.observe("req-after", [9100, 9101] + BODY) is None and not hint.sample  # once, then forgotten


def plan(capsys, traffic: str, *extra: str) -> str:
    flags = [
        "--traffic",
        str(DATA / traffic),
        "--device-memory",
        "8000000000",
        "--gpu-memory-utilization",
        "0.5",
        *extra,
    ]
    assert main(["--log-level", "WARNING", "plan", *flags]) == 0
    return capsys.readouterr().out


def figure(output: str, name: str) -> int:
    return int(re.search(rf"^{re.escape(name)} +([\d,]+)", output, re.M).group(1).replace(",", ""))


def test_plan_on_the_shipped_samples(capsys):
    english, thai = plan(capsys, "chat_en.jsonl"), plan(capsys, "chat_th.jsonl")
    stamped = plan(capsys, "chat_en_timestamp_first.jsonl")
    # The same requests in Thai: several times the tokens, a fraction of the sequences that fit.
    assert figure(thai, "tokens per request p50") > 3 * figure(english, "tokens per request p50")
    assert figure(thai, "sequences that fit at p95") * 3 < figure(english, "sequences that fit at p95")
    assert re.search(r"^  Thai +[\d,]+ tokens", thai, re.M) and "Thai" not in english
    assert "no varying head before a shared body found" in english
    assert "12 of 12 requests share a body" in stamped
