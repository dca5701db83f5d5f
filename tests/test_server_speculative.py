"""A server started with --speculative-config: completions come out as an engine without speculation gives them,
and /metrics carries vLLM's spec_decode counters (accepted tokens by position too)."""

from __future__ import annotations

import json

import httpx
import pytest
from jpaged_server.api_server import build_app
from server_harness import SMALL_ENGINE_ARGS, metric_samples, serve_in_thread

from jpaged import LLM, SamplingParams
from jpaged.config import EngineConfig
from jpaged.engine.async_engine import AsyncLLMEngine
from jpaged.entrypoints.cli import build_parser, engine_config_from_args, main

SPEC = {"method": "suffix", "num_speculative_tokens": 3}
PROMPT = list(range(300, 310)) * 3
ALLOWED = list(
    range(300, 310)
)  # the text held to the prompt's ten tokens: it repeats, proposals are accepted


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    args = build_parser().parse_args(["serve", "--speculative-config", json.dumps(SPEC)])
    spec = engine_config_from_args(args).speculative_config  # the flag's JSON, parsed
    config = EngineConfig(model=str(tiny_llama_dir), **SMALL_ENGINE_ARGS, speculative_config=spec)
    engine = AsyncLLMEngine.from_config(config)
    with serve_in_thread(build_app(engine, "tiny-llama")) as running:
        yield running
    engine.shutdown(timeout=5.0)


def spec_samples(server) -> dict[str, float]:
    """The spec_decode samples of /metrics, keyed `name` or `name{position}`."""
    return metric_samples(server.base_url, "spec_decode", "position")


def test_completions_equal_an_engine_without_speculation_and_the_counters_show_acceptance(
    server, tiny_llama_dir
):
    body = {
        "model": "tiny-llama",
        "prompt": PROMPT,
        "max_tokens": 30,
        "temperature": 0,
        "ignore_eos": True,
        "allowed_token_ids": ALLOWED,
        "return_token_ids": True,
    }
    got = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
    plain = LLM(str(tiny_llama_dir), **SMALL_ENGINE_ARGS)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, allowed_token_ids=ALLOWED)
    assert (
        got["choices"][0]["token_ids"]
        == plain.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    )
    samples = spec_samples(server)
    drafts, accepted = (
        samples["jpaged:spec_decode_num_draft_tokens_total"],
        samples["jpaged:spec_decode_num_accepted_tokens_total"],
    )
    assert samples["jpaged:spec_decode_num_drafts_total"] > 0 and 0 < accepted <= drafts
    per_position = [samples[f"jpaged:spec_decode_num_accepted_tokens_per_pos_total{{{j}}}"] for j in range(3)]
    assert sum(per_position) == accepted and per_position[0] >= per_position[1] >= per_position[2]


def test_bench_serve_reports_the_runs_acceptance_from_the_servers_counters(server, tmp_path, capsys):
    before = spec_samples(server)
    result = tmp_path / "result.json"
    argv = ["bench", "serve", "--base-url", server.base_url, "--model", "tiny-llama", "--disable-tqdm"]
    argv += ["--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "12", "--ignore-eos"]
    assert main([*argv, "--save-result", "--result-filename", str(result)]) == 0
    after = spec_samples(server)
    saved = json.loads(result.read_text())["spec_decode"]
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        name = f"jpaged:spec_decode_{key}_total"
        assert saved[key] == after[name] - before[name]
    assert "Acceptance rate (%):" in capsys.readouterr().out
