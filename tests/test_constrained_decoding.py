"""Structured outputs in the engine: a constrained request's output follows its grammar (a JSON schema, a regex,
a choice), greedy or sampled, n > 1 included, and stops when the grammar is complete; an unconstrained request in
the same batch gets what it gets alone; the masks are filled while the step's forward runs; a grammar that does not
compile is a ValueError naming it; and a warmed engine compiles nothing for any of it (the token bitmask is a
fixed-shape input)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from jpaged.entrypoints.llm import LLM
from jpaged.models.loader import load_model
from jpaged.sampling_params import SamplingParams, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ENGINE = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128, num_blocks=160)


def asked(*questions: str) -> list[list[dict]]:
    return [[{"role": "user", "content": q}] for q in questions]


@pytest.fixture(scope="module")
def llm():
    return LLM(_loaded=load_model(None, progress=False), enforce_eager=True, **ENGINE)


def constrained(max_tokens: int, **spec) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, structured_outputs=StructuredOutputsParams(**spec)
    )


def test_constrained_and_unconstrained_requests_share_a_batch(llm):
    conversations = asked(
        "Describe a person as JSON.", "Give me a phone number.", "Is ice cold?", "Name a colour."
    )
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    params = [
        constrained(80, json=PERSON),
        constrained(20, regex=r"[0-9]{3}-[0-9]{4}"),
        constrained(10, choice=["yes", "no"]),
        plain,
    ]
    outputs = llm.chat(conversations, params, use_tqdm=False)
    person = json.loads(outputs[0].outputs[0].text)
    jsonschema.validate(person, PERSON)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", outputs[1].outputs[0].text)
    assert outputs[2].outputs[0].text in ("yes", "no")
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs[:3])
    alone = llm.chat(conversations[3:], plain, use_tqdm=False)[0].outputs[0]
    assert outputs[3].outputs[0].token_ids == alone.token_ids


def test_every_parallel_sample_follows_the_grammar(llm):
    params = SamplingParams(
        n=3, max_tokens=80, temperature=1.0, seed=5, structured_outputs=StructuredOutputsParams(json=PERSON)
    )
    (output,) = llm.chat(asked("Describe a person as JSON."), params, use_tqdm=False)
    for sample in output.outputs:
        if sample.finish_reason == "stop":
            jsonschema.validate(json.loads(sample.text), PERSON)
        else:  # cut by max_tokens mid-structure: says so
            assert sample.finish_reason == "length"
    assert any(s.finish_reason == "stop" for s in output.outputs)


def test_the_grammar_masks_are_filled_while_the_steps_forward_runs(llm):
    """Each step's forward is on the device before the host fills its rows' masks; the sampling, which reads
    them, is dispatched after."""
    engine = llm.engine
    runner, sampling = engine.runner, engine.sampling
    events = []

    def recorded(name, call):
        def record(*args):
            events.append(name)
            return call(*args)

        return record

    runner.forward = recorded("forward", runner.forward)
    runner.sample = recorded("sample", runner.sample)
    sampling.inputs = recorded("fill", sampling.inputs)
    try:
        (output,) = llm.generate(["x"], constrained(10, regex=r"[0-9]{6}"), use_tqdm=False)
    finally:
        del runner.forward, runner.sample, sampling.inputs
    assert re.fullmatch(r"[0-9]{6}", output.outputs[0].text)
    assert len(events) >= 3 * 4  # a step a digit or more; each forward, fill, sample
    assert events == ["forward", "fill", "sample"] * (len(events) // 3)


def test_a_grammar_that_does_not_compile_is_a_value_error_naming_it(llm):
    with pytest.raises(ValueError, match="regex"):
        llm.generate(["x"], constrained(5, regex="(unclosed"), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_a_warmed_engine_compiles_nothing_for_constrained_requests(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("smollm2_tied")), **ENGINE)
    compiled = llm.metrics()["num_compilations"]
    params = [constrained(6, choice=["red", "green"]), SamplingParams(max_tokens=6, logprobs=3, seed=1)]
    llm.generate(["a", "b"], params, use_tqdm=False)
    llm.generate(["c"], constrained(8, regex=r"[a-z]{2,5}"), use_tqdm=False)
    assert llm.metrics()["num_compilations"] == compiled
