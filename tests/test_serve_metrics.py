"""A serving benchmark's figures, hand-checked on requests with known chunk timings: vLLM's definitions of TTFT,
TPOT (after the first token), ITL (every gap between chunks), end-to-end latency, percentiles by linear
interpolation, throughputs over the wall time, and goodput against SLOs."""

from __future__ import annotations

import pytest

from jpaged.benchmarks.serve_metrics import RequestTiming, parse_goodput, serve_metrics

REQUESTS = [
    # 3 tokens: the first at 100 ms, then chunks 20 and 40 ms apart; TPOT (160 - 100) / 2 = 30 ms
    RequestTiming(True, prompt_tokens=10, output_tokens=3, ttft=0.100, itl=(0.020, 0.040), latency=0.160),
    # 2 tokens: TPOT (350 - 300) / 1 = 50 ms
    RequestTiming(True, prompt_tokens=20, output_tokens=2, ttft=0.300, itl=(0.050,), latency=0.350),
    RequestTiming(False, prompt_tokens=99),  # failed: counted, never measured
    # 1 token: no TPOT (0 for goodput)
    RequestTiming(True, prompt_tokens=5, output_tokens=1, ttft=0.200, latency=0.200),
]


def test_counts_and_throughputs_are_over_the_wall_time():
    metrics = serve_metrics(REQUESTS, duration_s=2.0)
    assert (metrics.completed, metrics.failed) == (3, 1)
    assert (metrics.total_input_tokens, metrics.total_output_tokens) == (35, 6)
    assert metrics.request_throughput == 1.5
    assert metrics.output_throughput == 3.0
    assert metrics.total_token_throughput == 20.5
    assert metrics.request_goodput is None


def test_latency_distributions_in_milliseconds():
    metrics = serve_metrics(REQUESTS, duration_s=2.0, percentiles=(50, 99))
    ttft = metrics.ttft  # 100, 300, 200
    assert (ttft.mean, ttft.median) == pytest.approx((200.0, 200.0))
    assert ttft.std == pytest.approx((20000 / 3) ** 0.5)
    assert ttft.percentiles == pytest.approx({50.0: 200.0, 99.0: 298.0})  # 200 + 0.98 * (300 - 200)
    tpot = metrics.tpot  # 30, 50: the one-token request has none
    assert (tpot.mean, tpot.median, tpot.percentiles[99.0]) == pytest.approx((40.0, 40.0, 49.8))
    itl = metrics.itl  # 20, 40, 50: every gap of every request
    assert (itl.mean, itl.median, itl.percentiles[99.0]) == pytest.approx((110 / 3, 40.0, 49.8))
    e2el = metrics.e2el  # 160, 350, 200
    assert (e2el.mean, e2el.median) == pytest.approx((710 / 3, 200.0))


def test_goodput_counts_the_requests_within_every_slo():
    # ttft <= 250 ms and tpot <= 40 ms: the first (100, 30) and the one-token request (200, 0); not the second.
    metrics = serve_metrics(REQUESTS, duration_s=2.0, goodput=parse_goodput(["ttft:250", "tpot:40"]))
    assert metrics.request_goodput == 1.0
    assert serve_metrics(REQUESTS, 2.0, goodput={"e2el": 150.0}).request_goodput == 0.0


def test_no_successful_request_gives_zeros_not_an_error():
    metrics = serve_metrics([RequestTiming(False, prompt_tokens=3)], duration_s=1.0)
    assert (metrics.completed, metrics.failed, metrics.ttft.mean, metrics.itl.percentiles[99.0]) == (
        0,
        1,
        0,
        0,
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("latency:5", "'latency' is not one of ttft, tpot, e2el"),
        ("ttft:fast", "needs a number of milliseconds"),
        ("tpot:0", "must be > 0 ms"),
    ],
)
def test_a_bad_goodput_spec_is_a_clear_error(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_goodput([spec])
