"""LLM.generate and LLM.chat take vLLM's prompt forms: a str, token ids, {"prompt": str} (TextPrompt),
{"prompt_token_ids": [...]} (TokensPrompt), one or a list mixing them; any other form is a ValueError naming it."""

from __future__ import annotations

import pytest

from jpaged.entrypoints.llm import LLM
from jpaged.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("llama")), enforce_eager=True, max_num_seqs=8, max_num_batched_tokens=64)


def tokens_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain(llm):
    """The plain forms' greedy outputs: the text, and its token ids."""
    ids = llm.tokenizer.encode(TEXT, add_special_tokens=False)
    return ids, tokens_of(llm.generate(TEXT, GREEDY, use_tqdm=False))[0]


def test_a_tokens_prompt_dict_generates_as_its_token_ids(llm, plain):
    ids, expected = plain
    assert tokens_of(llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)) == [expected]
    assert tokens_of(llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)) == [expected]


def test_a_text_prompt_dict_generates_as_its_text(llm, plain):
    _, expected = plain
    assert tokens_of(llm.generate({"prompt": TEXT}, GREEDY, use_tqdm=False)) == [expected]


def test_a_list_mixing_every_form_keeps_its_order(llm, plain):
    ids, expected = plain
    other = "One two three"
    other_expected = tokens_of(llm.generate(other, GREEDY, use_tqdm=False))[0]
    prompts = [{"prompt": TEXT}, other, {"prompt_token_ids": ids}, ids, {"prompt": other, "cache_salt": "x"}]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens_of(outputs) == [expected, other_expected, expected, expected, other_expected]
    assert outputs[2].prompt_token_ids == ids


def test_chat_takes_one_conversation_or_a_list_of_them(llm):
    one = [{"role": "user", "content": "Hi"}]
    two = [{"role": "user", "content": "Name a colour"}]
    single = tokens_of(llm.chat(one, GREEDY, use_tqdm=False))
    both = tokens_of(llm.chat([one, two], GREEDY, use_tqdm=False))
    assert len(both) == 2 and both[0] == single[0]
    assert both[1] == tokens_of(llm.chat(two, GREEDY, use_tqdm=False))[0]


@pytest.mark.parametrize(
    "prompt, named",
    [
        ({"text": "hello"}, "unknown keys ['text']"),
        ({}, "exactly one of 'prompt'"),
        ({"prompt": "a", "prompt_token_ids": [1, 2]}, "exactly one of 'prompt'"),
        ({"prompt": "a", "multi_modal_data": {"image": None}}, "multi_modal_data is not supported"),
        ({"prompt_token_ids": "1 2 3"}, "'prompt_token_ids' must be a list of ints"),
        ({"prompt": [1, 2]}, "'prompt' must be a str"),
        (3.5, "prompts[1] must be a str"),
    ],
)
def test_a_prompt_of_no_known_form_is_a_value_error_naming_it(llm, prompt, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("(", r"\(")):
        llm.generate(["fine", prompt], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_total_blocks
