"""The planner's arithmetic, hand-checked on a known sample and pool: percentiles of tokens per request, blocks
per sequence, sequences that fit, the preemption risk of a concurrency, and the recommended limits."""

from __future__ import annotations

import pytest

from jpaged.benchmarks.capacity_plan import capacity_plan

# 20 requests: 19 of 100 tokens and one of 1000.
SAMPLE = [100] * 19 + [1000]


def plan(concurrency: int = 4, num_blocks: int = 101):
    # 100 usable blocks of 16 tokens; SmolLM2-like 30 layers x 3 KV heads x 64 x float32: 46080 bytes a token.
    return capacity_plan(
        SAMPLE,
        num_blocks=num_blocks,
        block_size=16,
        bytes_per_token=2 * 30 * 3 * 64 * 4,
        max_model_len=2048,
        concurrency=concurrency,
    )


def test_token_percentiles_and_kv_bytes():
    result = plan()
    assert result["tokens per request p50"] == 100
    assert result["tokens per request p95"] == 145  # 100 + 0.05 * 900: linear between the 19th and 20th
    assert result["tokens per request max"] == 1000
    assert result["KV bytes per token"] == 46080
    assert result["KV bytes per block"] == 16 * 46080
    assert result["blocks available"] == 100


def test_sequences_that_fit_count_whole_blocks():
    result = plan()
    assert result["sequences that fit at p50"] == 14  # 100 tokens: 7 blocks; 100 // 7
    assert result["sequences that fit at p95"] == 10  # 145 tokens: 10 blocks
    assert result["sequences that fit at max_model_len"] == 0  # 2048 tokens: 128 blocks > 100
    assert result["recommended --max-num-seqs"] == 10
    assert result["recommended --max-model-len"] == 1024  # 1000 rounded up to a multiple of 256


def test_preemption_risk_grows_with_concurrency():
    # 14 requests of 7 blocks fill 98 of 100: only a set holding the 63-block request overflows.
    assert plan(concurrency=1)["preemption risk at 1 concurrent"] == 0.0
    # 5 x 7 + 63 = 98 fits; only two long ones (126) overflow: 1 - 0.95^6 - 6 x 0.05 x 0.95^5
    low = plan(concurrency=6)["preemption risk at 6 concurrent"]
    assert low == pytest.approx(1 - 0.95**6 - 6 * 0.05 * 0.95**5, abs=0.01)
    risky = plan(concurrency=8)["preemption risk at 8 concurrent"]  # over once the long one is drawn
    assert risky == pytest.approx(1 - 0.95**8, abs=0.02)
    assert plan(concurrency=15)["preemption risk at 15 concurrent"] == 1.0  # 15 x 7 = 105 > 100 always


def test_every_figure_says_how_it_was_computed():
    lines = plan().lines()
    assert any("100 blocks // ceil(145 / 16) = 10 blocks each" in line for line in lines)
    with pytest.raises(ValueError, match="no requests"):
        capacity_plan([], num_blocks=10, block_size=16, bytes_per_token=1, max_model_len=64, concurrency=1)
