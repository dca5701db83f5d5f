"""A warmed engine runs every request within its limits on the step programs warm-up compiled: logprobs of any
number, prompt logprobs, penalties, logit_bias, bad words, min_tokens, allowed_token_ids, stop strings, seeds,
truncation, n > 1 and beam search, alone and all in one batch. A compile would stall a live request."""

from __future__ import annotations

import pytest

from jpaged.entrypoints.llm import LLM
from jpaged.sampling_params import MAX_LOGIT_BIAS_TOKENS, SamplingParams

KINDS = {
    "logprobs 0": dict(logprobs=0),
    "logprobs 7": dict(logprobs=7),
    "logprobs 20": dict(logprobs=20),
    "prompt_logprobs": dict(prompt_logprobs=3),
    "penalties": dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
    "logit_bias": dict(logit_bias={5: 3.0, 9: -100.0}),
    "the largest logit_bias": dict(logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS_TOKENS), 0.1)),
    "bad_words": dict(bad_words=["the", " a"]),
    "min_tokens": dict(min_tokens=3),
    "allowed_token_ids": dict(allowed_token_ids=list(range(50, 900))),
    "stop strings": dict(stop=["\n", "."]),
    "seeded sampling, n=3": dict(n=3, temperature=0.9, seed=4),
    "top-k/top-p/min-p": dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=2),
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    """Decode steps of 24 rows: a midpoint of the shape ladder, where S is a token size, not a sequence size; a
    max_model_len with two penalty-history widths."""
    return LLM(
        str(tiny_model_dir("smollm2_tied")), max_model_len=2048, max_num_seqs=24, max_num_batched_tokens=64
    )


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_of_request_compiles_nothing(llm, kind):
    compiled = llm.metrics()["num_compilations"]
    llm.generate(["one two three", "a longer prompt " * 5], SamplingParams(max_tokens=5, **KINDS[kind]))
    assert llm.metrics()["num_compilations"] == compiled


def test_all_kinds_in_one_batch_and_beam_search_compile_nothing(llm):
    compiled = llm.metrics()["num_compilations"]
    params = [SamplingParams(max_tokens=5, **fields) for fields in KINDS.values()]
    llm.generate([f"prompt {i} " * (i + 1) for i in range(len(params))], params, use_tqdm=False)
    llm.beam_search(["beam me"], beam_width=3, max_tokens=4)
    assert llm.metrics()["num_compilations"] == compiled


def test_penalised_histories_of_every_width_compile_nothing(llm):
    """A penalised batch sends its history in the narrowest width its longest fits: each width compiled at
    warm-up."""
    assert llm.engine.runner.sampling_widths.history_widths == (1024, 2048)
    compiled = llm.metrics()["num_compilations"]
    params = SamplingParams(max_tokens=5, presence_penalty=0.5, repetition_penalty=1.2)
    outputs = llm.generate(["short", "a longer prompt " * 400], params, use_tqdm=False)
    assert len(outputs[1].prompt_token_ids) > 1024
    assert llm.metrics()["num_compilations"] == compiled
