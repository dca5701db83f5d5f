"""The GPU kernel for group-quantized matrices (pallas/gpu_grouped_matmul.py), run in Pallas' interpret mode: its
products are those of the matrix dequantised (a float64 numpy oracle on fresh random inputs, and XLA's
dequantise-then-dot in bfloat16) for 4-bit, 8-bit and float8 codes, any number of rows; pack puts each K step's
halves in the low and high nibbles; groups it cannot walk are refused. tests/test_pallas_lowering.py lowers it for
cuda, tests/test_quantized_checkpoints.py runs a model through it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_models import relative_error

from jpaged.models.grouped import GroupedMatrix, dequantize
from jpaged.pallas import gpu_grouped_matmul

K, N = 256, 48
CODES = {  # name -> (bits, a draw of codes [K, N])
    "4-bit": (4, lambda rng: jnp.asarray(rng.integers(0, 16, (K, N)), jnp.uint8)),
    "int8": (8, lambda rng: jnp.asarray(rng.integers(-128, 128, (K, N)), jnp.int8)),
    "uint8": (8, lambda rng: jnp.asarray(rng.integers(0, 256, (K, N)), jnp.uint8)),
    "float8": (8, lambda rng: jnp.asarray(rng.standard_normal((K, N)) * 50, jnp.float8_e4m3fn)),
}


def _matrix(codes: str, group: int, seed: int) -> GroupedMatrix:
    rng = np.random.default_rng(seed)
    bits, draw = CODES[codes]
    scale = jnp.asarray(rng.random((K // group, N)) * 0.02 + 0.001, jnp.float16)
    bias = jnp.asarray(rng.standard_normal((K // group, N)) * 0.05, jnp.float32)
    return GroupedMatrix(draw(rng), scale, bias, bits)


def _product(x, matrix: GroupedMatrix):
    codes = gpu_grouped_matmul.pack(matrix.codes, bits=matrix.bits, group=matrix.group_size)
    return gpu_grouped_matmul.matmul(x, codes, matrix.scale, matrix.bias, bits=matrix.bits, interpret=True)


@pytest.mark.parametrize(
    ("codes", "group"), [("4-bit", 128), ("4-bit", 32), ("int8", 64), ("uint8", 16), ("float8", 128)]
)
@pytest.mark.parametrize("rows", [1, 19])
def test_the_kernel_gives_the_float64_product_of_the_dequantised_matrix(codes, group, rows):
    matrix = _matrix(codes, group, seed=rows + group)
    x = np.random.default_rng(rows).standard_normal((rows, K)).astype(np.float32)
    w = np.asarray(matrix.codes, np.float64) * np.repeat(np.asarray(matrix.scale, np.float64), group, 0)
    w += np.repeat(np.asarray(matrix.bias, np.float64), group, 0)
    got = np.asarray(_product(jnp.asarray(x), matrix))
    assert got.shape == (rows, N) and got.dtype == np.float32
    assert relative_error(got, x.astype(np.float64) @ w) < 1e-5


@pytest.mark.parametrize("codes", ["4-bit", "int8", "float8"])
def test_in_bfloat16_it_gives_xlas_dequantise_then_dot(codes):
    matrix = _matrix(codes, 64, seed=7)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((5, K)), jnp.bfloat16)
    got = _product(x, matrix)
    expected = jnp.dot(x, dequantize(matrix, jnp.bfloat16), preferred_element_type=jnp.float32)
    assert got.dtype == jnp.bfloat16
    assert (
        relative_error(np.asarray(got, np.float32), np.asarray(expected)) < 1e-2
    )  # bfloat16's output rounding


def test_pack_puts_each_k_steps_first_half_in_the_low_nibbles_and_its_second_half_in_the_high():
    codes = jnp.asarray(
        np.random.default_rng(0).integers(0, 16, (128, 16)), jnp.uint8
    )  # group 64: steps of 64
    packed = np.asarray(gpu_grouped_matmul.pack(codes, bits=4, group=64))
    assert packed.shape == (64, 16)
    for step in (0, 1):
        rows = np.asarray(codes[64 * step : 64 * (step + 1)])
        assert np.array_equal(packed[32 * step : 32 * (step + 1)] & 15, rows[:32])
        assert np.array_equal(packed[32 * step : 32 * (step + 1)] >> 4, rows[32:])


def test_a_group_the_kernel_cannot_walk_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="group size 24"):
        gpu_grouped_matmul.k_step(24, 4)
