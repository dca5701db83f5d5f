"""End-to-end generation on the embedded SmolLM2 (GGUF): equal to transformers, chat template, CLI, bad input."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import hf_model
from greedy import assert_same_greedy, hf_greedy

from jpaged import LLM, SamplingParams
from jpaged.engine.tokenizer import tokenize_bad_words

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "ประเทศไทยมีจังหวัดทั้งหมด",  # Thai: multi-byte characters split over byte-level tokens
    "Once upon a time, in a small village,",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(
        max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512, num_blocks=256, enforce_eager=True
    )


def test_greedy_tokens_equal_transformers_for_32_tokens(llm, default_gguf):
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        hf_tokens, _ = hf_greedy(default_gguf, output.prompt_token_ids, 32)
        assert len(output.outputs[0].token_ids) == 32
        assert_same_greedy(output.outputs[0], hf_tokens, label=prompt)


def test_returned_logprobs_are_the_model_log_softmax(llm, default_gguf):
    import torch

    output = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3), use_tqdm=False
    )[0]
    completion = output.outputs[0]
    ids = torch.tensor([output.prompt_token_ids + completion.token_ids])
    with torch.no_grad():
        logits = hf_model(default_gguf)(ids).logits[0].double()
    expected = torch.log_softmax(logits, -1).numpy()
    start = len(output.prompt_token_ids) - 1
    for step, entry in enumerate(completion.logprobs):
        assert len(entry) >= 3
        for token, logprob in entry.items():
            assert logprob.logprob == pytest.approx(expected[start + step, token], abs=2e-4)
        ranks = {lp.rank for token, lp in entry.items() if token != completion.token_ids[step]}
        assert ranks <= {1, 2, 3}


def test_chat_template_answers_the_capital_of_france(llm):
    output = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=24, temperature=0),
    )[0]
    assert "Paris" in output.outputs[0].text
    assert output.outputs[0].finish_reason == "stop"  # <|im_end|> ends the turn


def test_bad_words_are_never_generated(llm):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    output = llm.chat(question, SamplingParams(max_tokens=24, temperature=0, bad_words=["Paris"]))[0]
    banned = tokenize_bad_words(["Paris"], llm.tokenizer)
    tokens = output.outputs[0].token_ids
    for word in banned:
        assert not any(tokens[i : i + len(word)] == word for i in range(len(tokens)))
    assert "Paris" not in output.outputs[0].text


def test_prompt_longer_than_max_model_len_names_both_lengths(llm):
    with pytest.raises(ValueError, match=r"prompt is 600 tokens long, but max_model_len is 512"):
        llm.generate([[5] * 600], use_tqdm=False)
    assert llm.metrics()["num_free_blocks"] == llm.metrics()["num_total_blocks"]


def test_out_of_vocabulary_prompt_token_is_a_value_error(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**6]], use_tqdm=False)


def test_cli_generate_answers_paris():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "jpaged.entrypoints.cli",
            "generate",
            "What is the capital of France?",
            "--max-tokens",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Paris" in result.stdout


def test_jpaged_generate_convenience_returns_outputs():
    import jpaged

    outputs = jpaged.generate(["2 + 2 ="], max_tokens=3, temperature=0.0)
    assert len(outputs) == 1 and len(outputs[0].outputs[0].token_ids) == 3
    assert np.all(np.array(outputs[0].outputs[0].token_ids) >= 0)
