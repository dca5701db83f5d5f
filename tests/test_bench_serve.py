"""`jpaged bench serve` against a live server: every request streamed and counted (the server's usage gives the
token counts), vllm bench serve's table printed and its figures saved as JSON; requests the server refuses count
as failed; arrivals are a Poisson process scaled to the rate, or all at once."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from jpaged_server.api_server import build_app
from server_harness import serve_in_thread, small_engine

from jpaged.benchmarks.serve_client import arrival_times
from jpaged.benchmarks.spec_decode_counts import parse_counts
from jpaged.entrypoints.cli import main

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serve_in_thread(build_app(small_engine(tiny_model_dir), MODEL)) as running:
        yield running


def bench(server, tmp_path, *flags: str) -> tuple[int, dict]:
    result = tmp_path / "result.json"
    argv = ["bench", "serve", "--base-url", server.base_url, "--model", MODEL, "--disable-tqdm"]
    argv += ["--save-result", "--result-filename", str(result), *flags]
    code = main(argv)
    return code, json.loads(result.read_text())


def test_every_request_is_streamed_timed_and_counted(server, tmp_path, capsys):
    code, saved = bench(
        server, tmp_path, "--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "5",
        "--ignore-eos", "--max-concurrency", "3", "--metric-percentiles", "50,99", "--goodput", "ttft:600000",
    )  # fmt: skip
    assert code == 0
    assert (saved["completed"], saved["failed"]) == (6, 0)
    assert (saved["total_input_tokens"], saved["total_output_tokens"]) == (96, 30)
    assert saved["request_goodput"] == pytest.approx(saved["request_throughput"])  # a 10-minute TTFT SLO
    assert saved["output_throughput"] == pytest.approx(30 / saved["duration_s"])
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < saved[name]["median"] <= saved[name]["percentiles"]["99.0"]
    assert saved["ttft"]["mean"] < saved["e2el"]["mean"]
    table = capsys.readouterr().out
    assert re.search(r"^Successful requests: +6 *$", table, re.M) and re.search(
        r"^P99 TPOT \(ms\): +\d", table, re.M
    )


def test_a_concurrency_sweep_runs_each_point_and_draws_the_dial(server, tmp_path, capsys):
    plot = tmp_path / "dial.png"
    code, saved = bench(
        server, tmp_path, "--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "4",
        "--ignore-eos", "--sweep-concurrency", "1,4", "--plot", str(plot),
    )  # fmt: skip
    assert code == 0
    assert [p["max_concurrency"] for p in saved["points"]] == [1, 4]
    assert all(p["completed"] == 4 and p["total_output_tokens"] == 16 for p in saved["points"])
    table = capsys.readouterr().out
    assert re.search(r"^\| 1 \| [\d.]+ \| [\d.]+ \|", table, re.M) and re.search(r"^\| 4 \| ", table, re.M)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_request_rate_sweep_runs_each_rate_with_the_concurrency_given(server, tmp_path, capsys):
    code, saved = bench(
        server, tmp_path, "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "3",
        "--ignore-eos", "--max-concurrency", "2", "--sweep-request-rate", "50,inf",
    )  # fmt: skip
    assert code == 0
    assert [(p["request_rate"], p["max_concurrency"]) for p in saved["points"]] == [
        (50.0, 2),
        (float("inf"), 2),
    ]
    assert all(p["completed"] == 3 for p in saved["points"])
    table = capsys.readouterr().out
    assert re.search(r"^\| request rate \| req/s", table, re.M) and re.search(
        r"^\| inf \| [\d.]+ \|", table, re.M
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--sweep-request-rate", "4,0"], "sweep_request_rate values must be > 0, got 4,0"),
        (["--sweep-concurrency", "1,x"], "sweep_concurrency must be comma-separated numbers, got '1,x'"),
    ],
)
def test_a_sweep_of_bad_values_is_refused_naming_the_flag(server, flags, message, capsys):
    assert main(["bench", "serve", "--base-url", server.base_url, "--num-prompts", "1", *flags]) == 2
    assert capsys.readouterr().err == f"jpaged: error: {message}\n"


def test_requests_the_server_refuses_count_as_failed(server, tmp_path):
    # 300 prompt tokens do not fit the server's max_model_len of 256: every request gets a 400.
    code, saved = bench(server, tmp_path, "--num-prompts", "2", "--random-input-len", "300")
    assert code == 1
    assert (saved["completed"], saved["failed"]) == (0, 2)


def test_arrivals_are_poisson_scaled_to_the_rate_or_all_at_once():
    times = arrival_times(1000, 20.0, np.random.default_rng(0))
    assert np.all(np.diff(times) >= 0) and times[-1] == pytest.approx(1000 / 20.0)
    gaps = np.diff(times)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.1)  # exponential gaps: cv 1
    assert not arrival_times(5, float("inf"), np.random.default_rng(0)).any()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-prompts", "0"], "num_prompts must be >= 1"),
        (["--dataset", "/no/such/file.jsonl"], "neither 'random' nor a file"),
        (["--goodput", "speed:3"], "'speed' is not one of"),
        (["--percentile-metrics", "ttft,latency"], "latency"),
    ],
)
def test_bad_flags_are_clear_errors(flags, message, capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", *flags]) == 2
    assert message in capsys.readouterr().err


VLLM_METRICS = """# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0
"""


def test_spec_decode_counters_are_read_from_either_servers_metrics_and_differenced():
    after = parse_counts(VLLM_METRICS)
    before = parse_counts(
        VLLM_METRICS.replace("10.0", "4.0").replace("30.0", "12.0").replace("} 7.0", "} 1.0")
    )
    run = after - before
    assert (run.num_drafts, run.num_draft_tokens, run.num_accepted_tokens) == (6.0, 18.0, 0.0)
    assert run.accepted_per_position == (6.0, 0.0, 0.0)
    jpaged_named = parse_counts(VLLM_METRICS.replace("vllm:", "jpaged:"))
    assert jpaged_named == after and after.accepted_per_position == (7.0, 4.0, 1.0)
    assert parse_counts("# TYPE jpaged:prompt_tokens counter\njpaged:prompt_tokens_total 3.0\n") is None
    assert any(line.startswith("Acceptance length:") and "2.20" in line for line in after.report())
