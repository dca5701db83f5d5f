"""A step's host inputs travel to the device as one int32 buffer and come back out bit for bit."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jpaged.runner.packed_inputs import pack, unpack
from jpaged.runner.sampling_inputs import SamplingRow, SamplingWidths, build_sampling_tensors, split_wide
from jpaged.runner.step_batch import dummy_batch
from jpaged.sampling_params import SamplingParams


def step_inputs():
    rows = [
        SamplingRow(SamplingParams(temperature=0.7, top_p=0.9, seed=2**63 + 5), [1, 2], [3], seed=2**63 + 5),
        SamplingRow(SamplingParams(temperature=0.0, logit_bias={3: -100.0}), [4], [], seed=1),
    ]
    sampling, _ = split_wide(build_sampling_tensors(rows, 4, SamplingWidths(1000, history_len=16)))
    return dummy_batch(16, 4, 8), sampling, np.arange(16, dtype=np.int32)


def assert_same(actual, expected) -> None:
    flat_actual, tree_actual = jax.tree_util.tree_flatten(actual)
    flat_expected, tree_expected = jax.tree_util.tree_flatten(expected)
    assert tree_actual == tree_expected
    for got, want in zip(flat_actual, flat_expected, strict=True):
        got, want = np.asarray(got), np.asarray(want)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(
            got.view(np.uint8), want.view(np.uint8)
        )  # bit for bit, nan and -inf too


def test_the_step_inputs_come_back_out_of_one_int32_buffer_on_the_device():
    inputs = step_inputs()
    buffer, layout = pack(inputs)
    assert buffer.dtype == np.int32 and buffer.ndim == 1
    assert buffer.size == sum(np.asarray(x).size for x in jax.tree_util.tree_leaves(inputs))
    unpacked = jax.jit(functools.partial(unpack, layout=layout))(buffer)
    assert_same(unpacked, inputs)


def test_absent_fields_stay_absent_and_change_the_layout():
    batch, sampling, _ = step_inputs()
    with_targets, without = (
        pack((batch, sampling, np.zeros(16, np.int32)))[1],
        pack((batch, sampling, None))[1],
    )
    assert with_targets != without
    assert jax.jit(functools.partial(unpack, layout=without))(pack((batch, sampling, None))[0])[2] is None


def test_inputs_wider_than_32_bits_are_refused():
    with pytest.raises(ValueError, match="32-bit"):
        pack((np.zeros(3, np.int64),))
