"""The sampler's inputs: the same fields and shapes whatever the requests ask (one compiled sampler serves them
all), each row's token bitmask, and the rows of a beam search, whose top logprobs are its best allowed tokens."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from sampler_harness import WIDTHS, V, jitted_sample, rows_of, with_neutral_wide

from jpaged.runner.sampler import allowed_tokens, sample
from jpaged.runner.sampling_inputs import (
    WIDE_FIELDS,
    SamplingRow,
    SamplingTensors,
    SamplingWidths,
    build_sampling_tensors,
    neutral_wide,
)
from jpaged.sampling_params import MAX_LOGIT_BIAS_TOKENS, MAX_LOGPROBS, SamplingParams


def test_every_batch_has_the_same_shapes_and_wide_fields_only_where_a_row_needs_them():
    plain = build_sampling_tensors(rows_of(SamplingParams(temperature=0.8), 3), 8, WIDTHS)
    assert all(getattr(plain, f) is None for f in WIDE_FIELDS)  # the runner's device copies stand in
    assert plain.temperature[3:].tolist() == [0.0] * 5  # padded rows are greedy
    params = SamplingParams(presence_penalty=0.5, logit_bias={3: 1.0}, allowed_token_ids=[1, 2])
    full = build_sampling_tensors(rows_of(params, 3), 8, WIDTHS)
    shapes = {f: getattr(full, f).shape for f in WIDE_FIELDS}
    assert shapes == {
        "history": (8, WIDTHS.history_len),
        "bias_ids": (8, MAX_LOGIT_BIAS_TOKENS),
        "bias_values": (8, MAX_LOGIT_BIAS_TOKENS),
        "token_bitmask": (8, V // 32),
    }
    small = {f: getattr(plain, f).shape for f in SamplingTensors._fields if f not in WIDE_FIELDS}
    assert small == {f: getattr(full, f).shape for f in small}


def test_one_compiled_sampler_serves_every_kind_of_request():
    traces = []

    @jax.jit
    def step(logits, tensors):
        traces.append(1)
        return sample(logits, tensors)

    rng = np.random.default_rng(5)
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_k=5, logprobs=2),
        SamplingParams(temperature=0.0, logit_bias={7: 1.0}, presence_penalty=0.3),
        SamplingParams(allowed_token_ids=list(range(40)), min_tokens=3),
        SamplingParams(repetition_penalty=1.2, logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS_TOKENS), 0.5)),
    ]
    for i, params in enumerate(kinds):
        rows = rows_of(params, 3, outputs=rng.integers(0, V, i * 3).tolist())
        rows[0].eos_token_id = 2
        step(
            rng.normal(size=(8, V)).astype(np.float32),
            with_neutral_wide(build_sampling_tensors(rows, 8, WIDTHS)),
        )
    assert len(traces) == 1


def test_a_penalised_batch_sends_its_history_in_the_narrowest_width_that_fits():
    widths = SamplingWidths(V, history_len=20000)
    assert widths.history_widths == (1024, 8192, 20000)
    assert SamplingWidths(V, history_len=1024).history_widths == (1024,)
    assert SamplingWidths(V, history_len=64).history_widths == (64,)
    penalised = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.2)
    long_unpenalised = SamplingRow(SamplingParams(), list(range(5000)), [], 0)

    def history(rows):
        return build_sampling_tensors(rows, 8, widths).history

    short = rows_of(penalised, 2, outputs=[5, 5, 6], prompt=range(1000))
    assert history(short).shape == (8, 1024)
    assert history([*short, long_unpenalised]).shape == (8, 1024)  # only penalised rows send theirs
    assert (history([*short, long_unpenalised])[2] == V).all()
    assert history(rows_of(penalised, 1, prompt=range(1025))).shape == (8, 8192)
    assert history(rows_of(penalised, 1, prompt=range(9000))).shape == (8, 20000)
    assert neutral_wide(8, widths)["history"].shape == (8, 1024)


def test_penalties_do_not_depend_on_the_history_width():
    rows = rows_of(
        SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.7, logprobs=3),
        3,
        outputs=[4, 9, 9, 17],
    )
    narrow = with_neutral_wide(build_sampling_tensors(rows, 8, WIDTHS))
    wide = narrow._replace(history=np.pad(narrow.history, ((0, 0), (0, 448)), constant_values=V))
    logits = np.random.default_rng(2).normal(size=(8, V)).astype(np.float32)
    logits[:, [1, 2, 3, 4, 9, 17]] += 3.0  # the history's tokens are the ones the penalties must push down
    a, b = (jax.tree.map(np.asarray, jitted_sample(logits, t)) for t in (narrow, wide))
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    unpenalised = with_neutral_wide(
        build_sampling_tensors(rows_of(SamplingParams(temperature=0.0), 3), 8, WIDTHS)
    )
    assert not np.array_equal(np.asarray(jitted_sample(logits, unpenalised).token_ids)[:3], a.token_ids[:3])


def test_the_bitmask_allows_its_rows_tokens_less_the_bans():
    rows = [
        SamplingRow(SamplingParams(allowed_token_ids=[0, 31, 32, V - 1]), [1], [], 0),
        SamplingRow(SamplingParams(), [1], [5], 0, bad_words_token_ids=[[5, 33], [70]]),
        SamplingRow(SamplingParams(min_tokens=2, stop_token_ids=[9]), [1], [], 0, eos_token_id=2),
        SamplingRow(SamplingParams(allowed_token_ids=[4, 9], min_tokens=1, stop_token_ids=[9]), [1], [], 0),
    ]
    t = build_sampling_tensors(rows, 8, WIDTHS)
    allowed = np.asarray(allowed_tokens(t.token_bitmask, V))
    everything = np.ones(V, bool)
    expected = [np.isin(np.arange(V), [0, 31, 32, V - 1]), everything.copy(), everything.copy()]
    expected[1][[33, 70]] = False
    expected[2][[2, 9]] = False
    expected.append(np.isin(np.arange(V), [4]))
    np.testing.assert_array_equal(allowed[:4], np.stack(expected))
    assert allowed[4:].all()  # padding rows are unconstrained


def test_build_rejects_more_rows_than_num_rows_and_short_history():
    with pytest.raises(ValueError, match="num_rows"):
        build_sampling_tensors(rows_of(SamplingParams(), 3), 2, WIDTHS)
    rows = rows_of(SamplingParams(presence_penalty=0.5), 1, prompt=range(20))
    with pytest.raises(ValueError, match="history_len"):
        build_sampling_tensors(rows, 1, SamplingWidths(V, history_len=16))


def test_beam_rows_take_their_top_logprobs_among_the_allowed_tokens_with_raw_values():
    """A beam search under a grammar proposes its best allowed tokens (transformers' constrained beam search);
    any other constrained row keeps vLLM's raw top logprobs, disallowed tokens included."""
    allowed = np.array([3, 40, 41, 900])
    words = np.zeros(V // 32, np.uint32)
    np.bitwise_or.at(words, allowed >> 5, np.left_shift(np.uint32(1), (allowed & 31).astype(np.uint32)))
    params = SamplingParams(temperature=0.0, logprobs=6)
    rows = [
        SamplingRow(params, [1], [], 0, grammar_bitmask=words.view(np.int32), masked_top_logprobs=beam)
        for beam in (True, False)
    ]
    logits = np.random.default_rng(8).normal(size=(8, V)).astype(np.float32)
    out = jax.tree.map(
        np.asarray, jitted_sample(logits, with_neutral_wide(build_sampling_tensors(rows, 8, WIDTHS)))
    )
    raw = np.asarray(jax.nn.log_softmax(logits.astype(np.float64), axis=-1))
    best_allowed = allowed[np.argsort(-raw[0, allowed])]
    np.testing.assert_array_equal(out.logprob_token_ids[0, 1:5], best_allowed)
    np.testing.assert_allclose(out.logprobs[0, 1:5], raw[0, best_allowed], atol=1e-5)
    assert (out.logprobs[0, 5:] == -np.inf).all()  # fewer allowed tokens than K
    np.testing.assert_array_equal(out.logprob_token_ids[1, 1:], np.argsort(-raw[1])[:MAX_LOGPROBS])
    assert out.token_ids[0] == out.token_ids[1] == best_allowed[0]  # both sample under the mask
