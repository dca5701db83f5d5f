"""Prompt logprobs: vLLM's shape, equal to transformers' log_softmax at every prompt position, whatever the
chunking, and never skipped by a prefix-cache hit."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import hf_logits

from jpaged.config import EngineConfig
from jpaged.engine.llm_engine import LLMEngine
from jpaged.sampling_params import SamplingParams

PROMPT = [(7 * i * i + 3 * i + 11) % 49152 for i in range(70)]  # 4 full blocks and a partial one
ARGS = dict(max_num_seqs=8, max_model_len=128, num_blocks=64, enforce_eager=True)
TOP = 5


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> np.ndarray:
    """transformers' log_softmax [T, V] over the prompt, in float64."""
    logits = hf_logits(tiny_llama_dir, PROMPT).astype(np.float64)
    peak = logits.max(-1, keepdims=True)
    return logits - peak - np.log(np.exp(logits - peak).sum(-1, keepdims=True))


def run(engine: LLMEngine, request_id: str, params: SamplingParams):
    engine.add_request(request_id, PROMPT, params)
    last = None
    while engine.has_unfinished():
        for output in engine.step():
            last = output
    return last


def assert_equal_reference(prompt_logprobs, reference: np.ndarray, num_top: int) -> None:
    assert len(prompt_logprobs) == len(PROMPT) and prompt_logprobs[0] is None
    for position in range(1, len(PROMPT)):
        row, token, entry = reference[position - 1], PROMPT[position], prompt_logprobs[position]
        assert entry[token].logprob == pytest.approx(row[token], abs=1e-4)
        # Its rank, up to float32 rounding among the near-equal logprobs of a random model.
        assert 1 + np.sum(row > row[token] + 1e-5) <= entry[token].rank <= 1 + np.sum(row > row[token] - 1e-5)
        top = sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank)
        assert [lp.logprob for lp in top] == pytest.approx(np.sort(row)[::-1][:num_top], abs=1e-4)
        assert all(row[t] == pytest.approx(lp.logprob, abs=1e-4) for t, lp in entry.items())


@pytest.mark.parametrize("max_num_batched_tokens", [128, 16], ids=["whole_prompt", "chunks_of_16"])
def test_prompt_logprobs_equal_transformers_log_softmax(tiny_llama_dir, reference, max_num_batched_tokens):
    engine = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), max_num_batched_tokens=max_num_batched_tokens, **ARGS)
    )
    output = run(engine, "a", SamplingParams(max_tokens=2, prompt_logprobs=TOP))
    assert_equal_reference(output.prompt_logprobs, reference, TOP)


def test_prefix_cache_hits_never_skip_prompt_logprobs(tiny_llama_dir, reference):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), max_num_batched_tokens=128, **ARGS))
    run(engine, "warm", SamplingParams(max_tokens=1))  # caches the prompt's full blocks
    assert run(engine, "plain", SamplingParams(max_tokens=1)).num_cached_tokens == 64  # they are hittable
    output = run(engine, "logprobs", SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert output.num_cached_tokens == 0
    assert all(len(entry) == 1 for entry in output.prompt_logprobs[1:])  # prompt_logprobs=0: the token only
    assert_equal_reference(output.prompt_logprobs, reference, 0)
    assert (
        run(engine, "after", SamplingParams(max_tokens=1)).num_cached_tokens == 64
    )  # the cache still serves


def test_requests_without_prompt_logprobs_report_none(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), max_num_batched_tokens=128, **ARGS))
    assert run(engine, "a", SamplingParams(max_tokens=1)).prompt_logprobs is None
