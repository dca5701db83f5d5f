"""Comparing greedy outputs honestly: equal token for token, except after a genuine near-tie."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from conftest import hf_model

from jpaged import LLM, SamplingParams
from jpaged.outputs import CompletionOutput, RequestOutput

NEAR_TIE = 1e-3  # top-2 logprob gap under which float rounding may legitimately flip the argmax
# bfloat16 against float32: one bfloat16 spacing of a logit in [32, 64) (the embedded model's top logits measured
# 12-35), the most that rounding the two logits alone can move their gap.
BFLOAT16_NEAR_TIE = 2.0**-8 * 64


def assert_same_greedy(
    reference: CompletionOutput, other: Sequence[int], label: str = "", near_tie: float = NEAR_TIE
) -> None:
    """`other` must equal the reference's tokens, or diverge only where the reference's top two were within
    `near_tie` (the reference must have been generated with logprobs >= 2)."""
    for step, (expected, actual) in enumerate(zip(reference.token_ids, other, strict=False)):
        if expected == actual:
            continue
        assert reference.logprobs is not None, "the reference needs logprobs to judge a divergence"
        top = sorted(reference.logprobs[step].values(), key=lambda lp: -lp.logprob)[:2]
        gap = top[0].logprob - top[1].logprob
        assert gap < near_tie, (
            f"{label}: diverged at step {step} ({expected} vs {actual}) with a top-2 gap of {gap}"
        )
        return
    assert list(other) == list(reference.token_ids), f"{label}: same prefix but different lengths"


def hf_greedy(model_path, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' argmax path (the prompt in one forward, then one token a step over its KV cache, EOS
    included as with ignore_eos): the tokens and their logprobs."""
    import torch

    model, tokens, logprobs, past = hf_model(model_path), [], [], None
    step_input = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(num_tokens):
            out = model(step_input, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, int(out.logits[0, -1].argmax())
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(out.logits[0, -1].double(), -1)[token]))
            step_input = torch.tensor([[token]])
    return tokens, logprobs


def generate_greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[RequestOutput]:
    """Greedy completions of token prompts, EOS ignored, with the top-2 logprobs `assert_same_greedy` judges by."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def tokens_of(outputs: list[RequestOutput]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def assert_follows_transformers(
    model_dir, outputs: list[RequestOutput], label: str, tolerance: float
) -> None:
    """Each greedy completion is transformers' argmax path (`assert_same_greedy`), its tokens' logprobs within
    `tolerance` of transformers'."""
    for output in outputs:
        completion = output.outputs[0]
        tokens, logprobs = hf_greedy(model_dir, output.prompt_token_ids, len(completion.token_ids))
        assert_same_greedy(completion, tokens, label)
        ours = [step[token].logprob for step, token in zip(completion.logprobs, tokens, strict=True)]
        assert ours == pytest.approx(logprobs, abs=tolerance), label
