"""SamplingParams: vLLM's defaults, normalisation, and validation errors that name the field."""

from __future__ import annotations

import pytest

from jpaged.engine.tokenizer import tokenize_bad_words
from jpaged.sampling_params import MAX_LOGIT_BIAS_TOKENS, SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs, p.seed) == (16, 0, None, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and p.bad_words == []
    assert p.skip_special_tokens and p.detokenize and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.is_greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("presence_penalty", 2.1),
        ("frequency_penalty", -2.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("logprobs", 21),
        ("prompt_logprobs", 21),
        ("stop", [""]),
        ("stop", 3),
        ("stop_token_ids", ["2"]),
        ("allowed_token_ids", []),
        ("logit_bias", {"x": 1.0}),
        ("bad_words", [""]),
        ("seed", 1.5),
        ("output_kind", "delta"),
    ],
)
def test_invalid_value_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=5).max_tokens is None  # None: up to the context length


def test_logit_bias_beyond_the_samplers_fixed_width_is_rejected_naming_the_limit():
    SamplingParams(logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS_TOKENS), 1.0))
    with pytest.raises(ValueError, match=f"logit_bias has {MAX_LOGIT_BIAS_TOKENS + 1} entries; at most"):
        SamplingParams(logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS_TOKENS + 1), 1.0))


def test_greedy_with_several_samples_is_rejected():
    with pytest.raises(ValueError, match="n must be 1"):
        SamplingParams(temperature=0.0, n=2)


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop="x", detokenize=False)


def test_normalisation():
    p = SamplingParams(stop="END", stop_token_ids=[5, 5, 6], seed=-1, logit_bias={"7": 250.0, 8: -3})
    assert p.stop == ["END"] and p.stop_strings == ["END"]
    assert p.stop_token_ids == [5, 6]
    assert p.seed is None  # -1 means unseeded, as in vLLM
    assert p.logit_bias == {7: 100.0, 8: -3.0}  # keys as ints, values clamped like OpenAI


def test_zero_temperature_is_greedy_and_turns_truncation_off():
    p = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.3)
    assert p.is_greedy and (p.top_k, p.top_p, p.min_p) == (0, 1.0, 0.0)


def test_tiny_temperature_is_raised_to_a_stable_minimum():
    assert SamplingParams(temperature=1e-3).temperature == 1e-2


def test_clone_is_deep():
    p = SamplingParams(stop=["a"], logit_bias={1: 1.0})
    q = p.clone()
    q.stop.append("b")
    q.logit_bias[2] = 2.0
    assert p.stop == ["a"] and p.logit_bias == {1: 1.0}


@pytest.mark.parametrize(
    ("field", "value"), [("stop_token_ids", [50]), ("allowed_token_ids", [1, -1]), ("logit_bias", {99: 1.0})]
)
def test_check_for_vocab_names_the_field_with_out_of_range_ids(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=f"^{field} "):
        params.check_for_vocab(32)
    SamplingParams(**{field: [3] if field != "logit_bias" else {3: 1.0}}).check_for_vocab(32)


class _WordTokenizer:
    """Splits on characters; a leading space becomes its own marker token, like byte-level BPE's 'Ġ'."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [ord(c) for c in text.lstrip(" ")]
        return [1000 + ids[0], *ids[1:]] if text.startswith(" ") and ids else ids


def test_bad_words_are_banned_at_the_start_and_after_a_space():
    assert tokenize_bad_words(["ab"], _WordTokenizer()) == [[97, 98], [1097, 98]]


def test_bad_word_with_no_tokens_is_rejected():
    with pytest.raises(ValueError, match="bad_words"):
        tokenize_bad_words([" "], _WordTokenizer())
