"""Sampling at the engine level: n samples share their prompt's blocks, seeds reproduce whatever the batch,
temperature 0 is greedy, and streamed Thai text never shows a broken character."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import hf_logits
from engine_driver import run_requests

from jpaged.config import EngineConfig
from jpaged.engine.detokenizer import REPLACEMENT_CHAR
from jpaged.engine.llm_engine import LLMEngine
from jpaged.sampling_params import SamplingParams

LONG_PROMPT = [(5 * i * i + 17 * i + 3) % 49152 for i in range(100)]  # 6 full blocks and 4 tokens of a 7th
ARGS = dict(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256, num_blocks=96, enforce_eager=True)


def make(model, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(**{**ARGS, **overrides}), model=model)


def used_blocks(engine: LLMEngine) -> int:
    return engine.blocks.num_total_blocks - engine.blocks.num_free_blocks


def test_four_samples_allocate_the_prompt_blocks_once_and_differ(tiny_llama):
    one, four = make(tiny_llama), make(tiny_llama)
    one.add_request("a", LONG_PROMPT, SamplingParams(n=1, max_tokens=8, seed=0, ignore_eos=True))
    four.add_request("a", LONG_PROMPT, SamplingParams(n=4, max_tokens=8, seed=0, ignore_eos=True))
    one.step(), four.step()  # the whole prompt, then the first token of each sample
    assert len(four.requests["a"].seqs) == 4
    assert used_blocks(four) == used_blocks(one) == 7  # four samples, one copy of the prompt
    one.step(), four.step()
    # Writing their second token, three samples copy the shared partial block; the last one owns it then.
    assert used_blocks(four) == used_blocks(one) + 3
    outputs = run_requests(four, {})["a"].outputs
    assert len({tuple(o.token_ids) for o in outputs}) == 4
    assert four.blocks.num_free_blocks == four.blocks.num_total_blocks  # cached blocks count as free


def test_more_samples_than_max_num_seqs_are_refused_up_front(tiny_llama):
    """All n samples are drawn from the prompt's last step, so they must fit in one; queued, such a request would
    wait forever and hold up every request behind it."""
    engine = make(tiny_llama)
    with pytest.raises(ValueError, match=r"^n must be at most max_num_seqs \(8\).* got 9"):
        engine.add_request("a", LONG_PROMPT, SamplingParams(n=9, max_tokens=2))
    assert not engine.has_unfinished()
    outputs = run_requests(engine, {"b": (LONG_PROMPT, SamplingParams(n=8, max_tokens=2, ignore_eos=True))})
    assert len(outputs["b"].outputs) == 8
    assert engine.blocks.num_free_blocks == engine.blocks.num_total_blocks


def test_argmax_samples_that_copied_the_shared_block_continue_like_a_single_run(tiny_llama):
    """Three of the four samples write into a copy of the prompt's partial block: the copy must carry its K/V.
    (top_k=1: sampling restricted to the argmax, as n > 1 is refused at temperature 0.)"""
    greedy = dict(temperature=1.0, top_k=1, max_tokens=10, seed=3, ignore_eos=True)
    single = run_requests(make(tiny_llama), {"a": (LONG_PROMPT, SamplingParams(**greedy))})["a"]
    four = run_requests(make(tiny_llama), {"a": (LONG_PROMPT, SamplingParams(n=4, **greedy))})["a"]
    assert [o.token_ids for o in four.outputs] == [single.outputs[0].token_ids] * 4


def test_a_seeded_sample_is_the_same_alone_and_in_a_batch(tiny_llama):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    alone = run_requests(make(tiny_llama), {"x": (LONG_PROMPT[:30], params)})["x"].outputs[0].token_ids
    neighbours = {
        f"n{i}": (LONG_PROMPT[i : 20 + 13 * i], SamplingParams(max_tokens=5 + i, seed=i, ignore_eos=True))
        for i in range(5)
    }
    busy = make(
        tiny_llama, max_num_batched_tokens=32
    )  # the prompt is chunked and shares steps with the others
    batched = run_requests(busy, {**neighbours, "x": (LONG_PROMPT[:30], params)})["x"].outputs[0].token_ids
    assert batched == alone


def test_different_seeds_give_different_samples(tiny_llama):
    engine = make(tiny_llama)
    params = [SamplingParams(max_tokens=8, seed=seed, ignore_eos=True) for seed in (1, 2)]
    outputs = run_requests(engine, {str(i): (LONG_PROMPT[:30], p) for i, p in enumerate(params)})
    assert outputs["0"].outputs[0].token_ids != outputs["1"].outputs[0].token_ids


def test_temperature_zero_is_greedy(tiny_llama, tiny_llama_dir):
    engine = make(tiny_llama)
    prompt = LONG_PROMPT[:30]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    only_the_best = SamplingParams(temperature=1.0, top_k=1, max_tokens=8, seed=5, ignore_eos=True)
    outputs = run_requests(engine, {"greedy": (prompt, greedy), "top1": (prompt, only_the_best)})
    tokens = outputs["greedy"].outputs[0].token_ids
    assert outputs["top1"].outputs[0].token_ids == tokens  # the sampling path restricted to the argmax
    for step, token in enumerate(tokens):  # and transformers' argmax, step by step
        logits = hf_logits(tiny_llama_dir, prompt + tokens[:step])[-1]
        best, second = np.sort(logits)[::-1][:2]
        assert token == int(np.argmax(logits)) or best - second < 1e-4


def test_streamed_thai_text_never_breaks_a_character():
    engine = LLMEngine(
        EngineConfig(
            max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, num_blocks=32, enforce_eager=True
        )
    )
    engine.add_request("thai", "ประเทศไทยมีจังหวัดทั้งหมด", SamplingParams(temperature=0.0, max_tokens=24))
    deltas, seen, held_back = [], "", 0
    while engine.has_unfinished():
        for output in engine.step():
            text, num_tokens = output.outputs[0].text, len(output.outputs[0].token_ids)
            assert REPLACEMENT_CHAR not in text
            assert text.startswith(seen)  # cumulative: earlier text is never revised
            deltas.append(text[len(seen) :])
            held_back += num_tokens > 0 and not deltas[-1] and not output.finished
            seen = text
    assert "".join(deltas) == output.outputs[0].text
    assert any("\u0e00" <= ch <= "\u0e7f" for ch in output.outputs[0].text)  # Thai came out
    assert held_back > 0  # some tokens ended inside a character, and the stream waited for the rest
