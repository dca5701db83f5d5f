"""Grammar layer (jpaged.structured) on the default model's tokenizer, with no engine: a matcher driven by a
stand-in sampler (any allowed token) must produce text its spec accepts, and the bitmask must mean what the engine
will apply on device."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
from json_schemas import OBJECT_SCHEMAS

from jpaged.sampling_params import SamplingParams, StructuredOutputsParams
from jpaged.structured import (
    GrammarCompiler,
    allocate_bitmask,
    allowed_tokens,
    fill_bitmasks,
    num_words,
)
from jpaged.structured.grammar_specs import declared_properties_only

EXTRA_IDS = 40  # the model's vocabulary is wider than the tokenizer's, as in many checkpoints


@pytest.fixture(scope="module")
def compiler(default_tokenizer):
    compiler = GrammarCompiler(default_tokenizer, len(default_tokenizer) + EXTRA_IDS)
    yield compiler
    compiler.shutdown()


def drive(matcher, rng: random.Random, eos: int, max_steps: int = 600) -> list[int]:
    """A stand-in sampler: EOS as soon as it is allowed, else half the time the lowest allowed id (punctuation,
    which closes strings and structures), else any allowed token. Returns the tokens before EOS."""
    row = np.zeros(num_words(matcher.vocab_size), np.int32)
    tokens = []
    for _ in range(max_steps):
        matcher.fill_bitmask(row)
        allowed = np.flatnonzero(allowed_tokens(row, matcher.vocab_size))
        assert len(allowed), "a matcher never allows nothing"
        token = eos if eos in allowed else int(allowed[0] if rng.random() < 0.5 else rng.choice(allowed))
        assert matcher.accept_token(token)
        if token == eos:
            assert matcher.is_terminated()
            return tokens
        tokens.append(token)
    raise AssertionError("the grammar never allowed EOS")


def test_the_twenty_schemas_have_nesting_arrays_enums_and_bounds():
    text = json.dumps(OBJECT_SCHEMAS)
    for keyword in (
        '"type": "object", "properties": {"',
        '"type": "array"',
        '"enum"',
        '"maximum"',
        '"required"',
    ):
        assert keyword in text


@pytest.mark.parametrize("index", range(len(OBJECT_SCHEMAS)))
def test_json_schema_outputs_parse_and_validate(compiler, default_tokenizer, index):
    schema = OBJECT_SCHEMAS[index]
    grammar = compiler.compile(StructuredOutputsParams(json=schema))
    for seed in range(3):
        tokens = drive(grammar.matcher(), random.Random(seed), default_tokenizer.eos_token_id)
        jsonschema.validate(json.loads(default_tokenizer.decode(tokens)), schema)


def test_json_object_starts_with_a_brace_and_accepts_any_object(compiler, default_tokenizer):
    matcher = compiler.compile(StructuredOutputsParams(json_object=True)).matcher()
    row = np.zeros(num_words(matcher.vocab_size), np.int32)
    matcher.fill_bitmask(row)
    starts = {default_tokenizer.decode([t]) for t in np.flatnonzero(allowed_tokens(row, matcher.vocab_size))}
    assert starts and all(text.startswith("{") for text in starts)
    text = '{"a":[1,{"b":null}],"c":"d"}'
    for token in default_tokenizer.encode(text, add_special_tokens=False):
        assert matcher.accept_token(token)
    assert matcher.is_terminated() and matcher.accept_token(default_tokenizer.eos_token_id)


def test_regex_outputs_match_the_whole_pattern(compiler, default_tokenizer):
    pattern = r"[A-Z][a-z]{2,5}-\d{3}(\.\d)?"
    grammar = compiler.compile(StructuredOutputsParams(regex=pattern))
    for seed in range(5):
        text = default_tokenizer.decode(
            drive(grammar.matcher(), random.Random(seed), default_tokenizer.eos_token_id)
        )
        assert re.fullmatch(pattern, text), text


def test_choice_outputs_are_one_of_the_choices(compiler, default_tokenizer):
    choices = ["positive", "negative", 'neutral "maybe"']
    grammar = compiler.compile(StructuredOutputsParams(choice=choices))
    seen = set()
    for seed in range(12):
        text = default_tokenizer.decode(
            drive(grammar.matcher(), random.Random(seed), default_tokenizer.eos_token_id)
        )
        assert text in choices
        seen.add(text)
    assert len(seen) > 1


def test_lark_grammar_outputs_are_in_its_language(compiler, default_tokenizer):
    lark = 'start: greeting " " NAME "!"\ngreeting: "hello" | "hi"\nNAME: /[a-z]{1,8}/'
    grammar = compiler.compile(StructuredOutputsParams(grammar=lark))
    for seed in range(5):
        text = default_tokenizer.decode(
            drive(grammar.matcher(), random.Random(seed), default_tokenizer.eos_token_id)
        )
        assert re.fullmatch(r"(hello|hi) [a-z]{1,8}!", text), text


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        (StructuredOutputsParams(json={"type": "frobnicate"}), "invalid JSON schema"),
        (
            StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
            "invalid",
        ),
        (StructuredOutputsParams(regex="a(b"), "invalid regex"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "invalid grammar"),
    ],
)
def test_a_spec_that_does_not_compile_is_a_value_error_naming_the_problem(compiler, spec, problem):
    handle = compiler.submit(spec)
    with pytest.raises(ValueError, match=problem):
        handle.result(timeout=30)
    assert handle.ready()


def test_compiles_are_cached_by_spec_whatever_the_key_order(compiler):
    first = compiler.submit(StructuredOutputsParams(json={"type": "object", "required": ["a"]}))
    again = compiler.submit(StructuredOutputsParams(json='{"required": ["a"], "type": "object"}'))
    assert first.future is again.future


def test_the_cache_forgets_the_least_recently_used_spec(default_tokenizer):
    compiler = GrammarCompiler(default_tokenizer, len(default_tokenizer), cache_size=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    first_a = compiler.submit(a)
    compiler.submit(b)
    assert compiler.submit(a).future is first_a.future  # a is now the most recent
    compiler.submit(c)  # evicts b
    assert compiler.submit(a).future is first_a.future
    first_b = compiler.submit(b)
    assert compiler.submit(b).future is first_b.future
    compiler.shutdown()


def test_submit_returns_before_the_compile_finishes(default_tokenizer):
    """The first compile also builds llguidance's view of the tokenizer (about a second): never on the caller."""
    compiler = GrammarCompiler(default_tokenizer, len(default_tokenizer))
    handle = compiler.submit(StructuredOutputsParams(regex="[0-9]+"))
    assert not handle.ready()
    handle.result(timeout=60)
    assert handle.ready()
    compiler.shutdown()


def test_tokens_beyond_the_tokenizer_are_never_allowed(compiler, default_tokenizer):
    matcher = compiler.compile(StructuredOutputsParams(json_object=True)).matcher()
    row = np.full(num_words(matcher.vocab_size), -1, np.int32)
    matcher.fill_bitmask(row)
    allowed = allowed_tokens(row, matcher.vocab_size)
    assert allowed.shape == (len(default_tokenizer) + EXTRA_IDS,)
    assert allowed[: len(default_tokenizer)].any()
    assert not allowed[len(default_tokenizer) :].any()


def test_the_bitmask_layout_is_bit_j_of_word_i_for_token_32i_plus_j():
    row = np.zeros(3, np.int32)
    row[0], row[2] = 1 << 5, np.int32(-(1 << 31))  # tokens 5 and 95 (the sign bit of the last word)
    assert list(np.flatnonzero(allowed_tokens(row, 96))) == [5, 95]
    assert allocate_bitmask(2, 70).shape == (2, 3) and allowed_tokens(allocate_bitmask(1, 70)[0], 70).all()


def test_a_disallowed_token_puts_the_matcher_in_an_error_state_that_allows_only_eos(
    compiler, default_tokenizer
):
    matcher = compiler.compile(StructuredOutputsParams(choice=["yes", "no"])).matcher()
    assert not matcher.accept_token(default_tokenizer.encode("maybe", add_special_tokens=False)[0])
    assert matcher.is_terminated() and matcher.error
    row = np.zeros(num_words(matcher.vocab_size), np.int32)
    matcher.fill_bitmask(row)
    assert list(np.flatnonzero(allowed_tokens(row, matcher.vocab_size))) == [default_tokenizer.eos_token_id]


def test_rollback_undoes_accepted_tokens(compiler, default_tokenizer):
    matcher = compiler.compile(StructuredOutputsParams(choice=["no way", "yes"])).matcher()
    row, before = (np.zeros(num_words(matcher.vocab_size), np.int32) for _ in range(2))
    matcher.fill_bitmask(before)
    ids = default_tokenizer.encode("no way", add_special_tokens=False)
    for token in ids:
        assert matcher.accept_token(token)
    assert matcher.is_terminated()
    matcher.rollback(len(ids))
    assert not matcher.is_terminated()
    matcher.fill_bitmask(row)
    assert (row == before).all()


def test_forks_advance_independently_for_parallel_samples(compiler, default_tokenizer):
    parent = compiler.compile(StructuredOutputsParams(choice=["yes", "no"])).matcher()
    child = parent.fork()
    assert child.accept_token(default_tokenizer.encode("no", add_special_tokens=False)[0])
    assert child.is_accepting() and not parent.is_accepting()
    assert parent.accept_token(default_tokenizer.encode("yes", add_special_tokens=False)[0])


def test_fill_bitmasks_fills_the_named_rows_of_a_batch_and_leaves_the_rest(compiler):
    grammar = compiler.compile(StructuredOutputsParams(regex="[0-9]+"))
    one = grammar.matcher()
    out = allocate_bitmask(4, one.vocab_size)
    fill_bitmasks([(one, 1), (grammar.matcher(), 3)], out)
    expected = np.zeros(num_words(one.vocab_size), np.int32)
    one.fill_bitmask(expected)
    assert (out[1] == expected).all() and (out[3] == expected).all()
    assert (out[0] == -1).all() and (out[2] == -1).all()


def test_fill_bitmask_refuses_a_row_of_the_wrong_shape(compiler):
    matcher = compiler.compile(StructuredOutputsParams(regex="a")).matcher()
    with pytest.raises(ValueError, match="int32 row"):
        matcher.fill_bitmask(np.zeros(num_words(matcher.vocab_size) - 1, np.int32))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"json": "{not json"}, "json is not valid JSON"),
        ({"json": "[1]"}, "json must be a JSON schema object"),
        ({"json": 3}, "json must be a JSON schema"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"choice": []}, "choice must be a non-empty list"),
        ({"choice": ["a", 2]}, "choice must be a non-empty list"),
        ({"grammar": 5}, "grammar must be a non-empty string"),
    ],
)
def test_structured_outputs_params_name_the_field_at_fault(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_carry_structured_outputs_through_clone():
    spec = StructuredOutputsParams(json={"type": "object"})
    params = SamplingParams(structured_outputs=spec)
    assert params.clone().structured_outputs == spec
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})


def test_object_schemas_allow_only_their_declared_properties_unless_they_say_otherwise():
    item = {"type": "object", "properties": {"a": {"type": "integer"}}}
    schema = {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": item},
            "open": {**item, "additionalProperties": True},
        },
        "$defs": {"d": item},
        "anyOf": [item],
    }
    closed = declared_properties_only(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["items"]["items"]["additionalProperties"] is False
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert (
        closed["$defs"]["d"]["additionalProperties"] is False
        and closed["anyOf"][0]["additionalProperties"] is False
    )
    assert "additionalProperties" not in schema and "additionalProperties" not in declared_properties_only(
        {"type": "object"}
    )
