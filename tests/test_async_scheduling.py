"""Async scheduling: step N+1 is scheduled while step N runs, its decode rows reading step N's tokens on the
device, and nothing a request gets changes: the same tokens, stops, logprobs and aborts as the serial loop, at the
cost of at most one extra computed token for a sequence whose last token it could not foresee."""

from __future__ import annotations

import pytest
from engine_driver import run_requests

from jpaged.config import EngineConfig
from jpaged.engine.llm_engine import LLMEngine
from jpaged.sampling_params import SamplingParams

SMALL = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_blocks=96, enforce_eager=True)


def engine(model, overlap: bool, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(**{**SMALL, "async_scheduling": overlap, **overrides}), model=model)


def record_dispatches(engine: LLMEngine) -> list:
    """Every step the runner starts, as (padded batch, sampling tensors)."""
    seen, batches = [], []
    runner = engine.runner
    forward, sample = runner.forward, runner.sample

    def recording_forward(prepared):
        batches.append(prepared.batch)
        return forward(prepared)

    def recording_sample(sampling):
        seen.append((batches[-1], sampling))
        return sample(sampling)

    runner.forward, runner.sample = recording_forward, recording_sample
    return seen


MIXED = {
    "greedy": ([5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
    "sampled": ([9, 10, 11], SamplingParams(max_tokens=10, temperature=0.9, top_p=0.8, seed=3)),
    "logprobs": ([12, 13], SamplingParams(max_tokens=7, temperature=0.0, logprobs=3)),
    "n3": ([14, 15, 16, 17], SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=5)),
    "penalised": ([18, 19], SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3)),
    "long_prompt": (list(range(100, 190)), SamplingParams(max_tokens=5, temperature=0.0)),
    "prompt_logprobs": ([20, 21, 22, 23], SamplingParams(max_tokens=4, prompt_logprobs=2)),
}


def logprob_values(entries) -> list[tuple[int, float]]:
    """(token, logprob) of every entry of a logprobs list (None entries skipped)."""
    return [(t, lp.logprob) for entry in entries or [] if entry for t, lp in entry.items()]


def test_every_kind_of_request_gets_the_same_output_with_and_without_overlap(tiny_llama):
    serial = run_requests(engine(tiny_llama, False), MIXED)
    overlapped = run_requests(engine(tiny_llama, True), MIXED)
    assert set(serial) == set(overlapped) == set(MIXED)
    for request_id in MIXED:
        ours, theirs = overlapped[request_id], serial[request_id]
        for a, b in zip(ours.outputs, theirs.outputs, strict=True):
            assert (a.index, a.token_ids, a.text, a.finish_reason) == (
                b.index,
                b.token_ids,
                b.text,
                b.finish_reason,
            ), request_id
            # batches differ by a row now and then (a finished sequence's extra token): floats to rounding
            for (t, x), (u, y) in zip(logprob_values(a.logprobs), logprob_values(b.logprobs), strict=True):
                assert t == u and x == pytest.approx(y, abs=1e-4)
        prompt = zip(
            logprob_values(ours.prompt_logprobs), logprob_values(theirs.prompt_logprobs), strict=True
        )
        for (t, x), (u, y) in prompt:
            assert t == u and x == pytest.approx(y, abs=1e-4)


def test_a_stop_string_found_late_still_cuts_the_text_where_it_starts(tiny_llama):
    free = run_requests(engine(tiny_llama, False), {"a": ([30, 31], SamplingParams(max_tokens=24, seed=7))})
    text = free["a"].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop
    params = SamplingParams(max_tokens=24, stop=[stop], seed=7)
    serial = run_requests(engine(tiny_llama, False), {"a": ([30, 31], params)})["a"].outputs[0]
    overlapped = run_requests(engine(tiny_llama, True), {"a": ([30, 31], params)})["a"].outputs[0]
    assert (overlapped.text, overlapped.token_ids, overlapped.finish_reason) == (
        serial.text,
        serial.token_ids,
        serial.finish_reason,
    )


def test_decode_rows_take_their_input_token_from_the_previous_step_on_the_device(tiny_llama):
    overlapped = engine(tiny_llama, True)
    steps = record_dispatches(overlapped)
    run_requests(overlapped, {"a": ([5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0))})
    prefill, *decodes = steps
    assert prefill[0].token_ids[:3].tolist() == [5, 6, 7]
    assert decodes and all(batch.token_ids[0] == -1 for batch, _ in decodes)  # row 0 of the step before

    serial = engine(tiny_llama, False)
    steps = record_dispatches(serial)
    run_requests(serial, {"a": ([5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0))})
    assert all(batch.token_ids[0] >= 0 for batch, _ in steps)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "async"])
def test_a_sequence_ending_at_max_tokens_computes_no_extra_token(tiny_llama, overlap):
    overlapped = engine(tiny_llama, overlap)
    steps = record_dispatches(overlapped)
    run_requests(overlapped, {"a": ([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))})
    assert len(steps) == 6  # the prompt, then the five decodes whose tokens are kept


def test_a_sequence_stopped_by_a_token_costs_at_most_one_extra_step(tiny_llama):
    params = SamplingParams(max_tokens=20, temperature=0.0)
    tokens = run_requests(engine(tiny_llama, False), {"a": ([40, 41], params)})["a"].outputs[0].token_ids
    params = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[tokens[3]])
    overlapped = engine(tiny_llama, True)
    steps = record_dispatches(overlapped)
    output = run_requests(overlapped, {"a": ([40, 41], params)})["a"].outputs[0]
    assert output.token_ids == tokens[: tokens.index(tokens[3]) + 1] and output.finish_reason == "stop"
    assert len(steps) <= len(output.token_ids) + 1
    assert overlapped.metrics()["kv_cache_usage_perc"] == 0.0


def test_an_abort_while_a_step_runs_returns_every_computed_token_and_frees_its_blocks(tiny_llama):
    overlapped = engine(tiny_llama, True)
    overlapped.add_request("a", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    overlapped.add_request("b", [8, 9], SamplingParams(max_tokens=50, ignore_eos=True))
    seen = {"a": 0, "b": 0}
    for _ in range(4):
        for output in overlapped.step():
            seen[output.request_id] = len(output.outputs[0].token_ids)
    assert seen["a"] == 3  # four steps started, three processed: one is on the device
    aborted = overlapped.abort_request("a").outputs[0]
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) == 4
    later = overlapped.step()  # "b"'s output from the step the abort processed
    assert [(o.request_id, len(o.outputs[0].token_ids)) for o in later] == [("b", 4)]
    overlapped.abort_request("b")
    assert overlapped.metrics()["kv_cache_usage_perc"] == 0.0 and not overlapped.has_unfinished()


def test_an_idle_engine_has_nothing_left_on_the_device(tiny_llama):
    overlapped = engine(tiny_llama, True)
    run_requests(overlapped, MIXED)
    assert not overlapped.has_unfinished()
    overlapped.sleep(1)  # what a trainer does between rollouts: refused while anything runs
    overlapped.wake_up()
    again = run_requests(overlapped, {"a": ([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0))})
    assert len(again["a"].outputs[0].token_ids) == 4
