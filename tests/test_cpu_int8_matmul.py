"""The C++ int8 kernel (cpu int8_matmul, the W8A8 form of --quantization int8) against XLA's form of the same
product (models.quantized: activations quantised per token, an int8 dot, the sums scaled back): the same bits on
fresh random operands, for any K (padded to the tiles' 64 inside), panels that do not fill their 16 columns, live
rows fewer than the batch, one layer of a stack, the gated form, and the builds for other CPUs (the AMX tiles on a
model of their instructions where the CPU has none)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cpu_matmul import runnable_build

from jpaged.models.activations import act_and_mul
from jpaged.models.quantized import QuantizedMatrix, quantize, quantized_matmul
from jpaged.pallas.cpu import int8_matmul


def _operands(rng, layers: int, m: int, k: int, n: int, dtype):
    w = quantize(rng.standard_normal((layers, k, n)) * np.linspace(0.5, 2, n), "int8")
    x = jnp.asarray(rng.standard_normal((m, k)) * 3, dtype)
    return x, w


def _xla(x, w: QuantizedMatrix, layer: int) -> np.ndarray:
    one = QuantizedMatrix(w.values[layer], w.scale[layer])
    return np.asarray(quantized_matmul(x, one, "int8").astype(jnp.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("m", "k", "n"), [(1, 64, 16), (7, 40, 24), (16, 576, 960), (40, 1536, 33), (70, 128, 50)]
)
def test_live_rows_are_xlas_w8a8_product_to_the_bit_and_the_rest_zero(m, k, n, dtype):
    rng = np.random.default_rng([m, k, n])
    x, w = _operands(rng, 3, m, k, n, dtype)
    layer, rows = int(rng.integers(0, 3)), int(rng.integers(1, m + 1))
    got = int8_matmul.matmul(x, int8_matmul.pack(w.values, w.scale), n, layer=layer, rows=rows)
    assert got.dtype == x.dtype and got.shape == (m, n)
    got = np.asarray(got.astype(jnp.float32))
    np.testing.assert_array_equal(got[:rows], _xla(x[:rows], w, layer))
    assert not got[rows:].any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_gated_form_is_the_activation_of_the_unfused_product(dtype):
    rng = np.random.default_rng(5)
    f = 48
    x, w = _operands(rng, 2, 9, 128, 2 * f, dtype)
    got = int8_matmul.gated_matmul(x, int8_matmul.pack(w.values, w.scale, gated=True), f, layer=1, rows=6)
    unfused = act_and_mul(jnp.asarray(_xla(x[:6], w, 1), x.dtype), (f, f), 1)
    got = np.asarray(got.astype(jnp.float32))
    # bfloat16: the same roundings in the same places (as the dense kernel's gated form); float32: within exp's
    np.testing.assert_allclose(got[:6], np.asarray(unfused.astype(jnp.float32)), rtol=1e-5, atol=1e-6)
    assert not got[6:].any()


def test_shapes_that_do_not_agree_are_a_value_error():
    w = quantize(np.ones((1, 64, 16), np.float32), "int8")
    panels = int8_matmul.pack(w.values, w.scale)
    with pytest.raises(ValueError, match="do not make"):
        int8_matmul.matmul(jnp.zeros((2, 128), jnp.float32), panels, 16)
    with pytest.raises(ValueError, match="must be float32 or bfloat16"):
        int8_matmul.matmul(jnp.zeros((2, 64), jnp.int8), panels, 16)


# The builds whose paths differ here (the vectorised loop with AVX2 and AVX-512, the tiles on their model).
@pytest.mark.parametrize("name", ["x86-64-v3", "x86-64-v4", "amx-model"])
def test_each_build_gives_xlas_bits(name, tmp_path_factory):
    target, _ = runnable_build(name, tmp_path_factory, "int8_matmul.cc", {"": "JpagedInt8Matmul"})
    rng = np.random.default_rng(11)
    for (m, k, n, rows), dtype in zip(
        [(5, 64, 40, 3), (40, 576, 33, 37), (64, 100, 16, 64)],
        ["bfloat16", "float32", "bfloat16"],
        strict=True,
    ):
        x, w = _operands(rng, 2, m, k, n, dtype)
        values, scale = int8_matmul.pack(w.values, w.scale)
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((m, n), jnp.float32))
        padded = jnp.pad(x, [(0, 0), (0, values.shape[2] * 4 - k)])
        got = np.asarray(call(padded, values, scale, jnp.ones(1, jnp.int32), jnp.full(1, rows, jnp.int32)))
        np.testing.assert_allclose(got[:rows], _xla(x[:rows], w, 1), rtol=1e-2 if dtype == "bfloat16" else 0)
        assert not got[rows:].any()
