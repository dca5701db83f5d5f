"""The C++ int8 kernel (cpu int8_matmul, the W8A8 form of --quantization int8) against exact int64 numpy sums on
fresh random int8 operands: any K (padded to the tiles' 64 inside), panels that do not fill their 16 columns, live
rows fewer than the batch, one layer of a stack, and the builds for other CPUs (the AMX tiles on a model of their
instructions where the CPU has none)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cpu_matmul import BUILDS, runnable_build

from jpaged.pallas.cpu import int8_matmul


def _operands(rng, layers: int, m: int, k: int, n: int):
    w = rng.integers(-127, 128, (layers, k, n)).astype(np.int8)
    x = rng.integers(-127, 128, (m, k)).astype(np.int8)
    return x, w


def _exact(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x.astype(np.int64) @ w.astype(np.int64)


@pytest.mark.parametrize(
    ("m", "k", "n"), [(1, 64, 16), (7, 40, 24), (16, 576, 960), (40, 1536, 33), (70, 128, 50)]
)
def test_live_rows_are_the_exact_int32_sums_and_the_rest_zero(m, k, n):
    rng = np.random.default_rng([m, k, n])
    x, w = _operands(rng, 3, m, k, n)
    layer, rows = int(rng.integers(0, 3)), int(rng.integers(1, m + 1))
    got = np.asarray(
        int8_matmul.matmul(jnp.asarray(x), int8_matmul.pack(jnp.asarray(w)), n, layer=layer, rows=rows)
    )
    assert got.dtype == np.int32 and got.shape == (m, n)
    np.testing.assert_array_equal(got[:rows], _exact(x[:rows], w[layer]))
    assert not got[rows:].any()


def test_the_kernel_equals_xlas_int8_dot_to_the_bit():
    rng = np.random.default_rng(3)
    x, w = _operands(rng, 1, 9, 576, 200)
    xla = jax.lax.dot(jnp.asarray(x), jnp.asarray(w[0]), preferred_element_type=jnp.int32)
    got = int8_matmul.matmul(jnp.asarray(x), int8_matmul.pack(jnp.asarray(w)), 200)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(xla))


def test_shapes_that_do_not_agree_are_a_value_error():
    panels = int8_matmul.pack(jnp.zeros((1, 64, 16), jnp.int8))
    with pytest.raises(ValueError, match="do not make"):
        int8_matmul.matmul(jnp.zeros((2, 128), jnp.int8), panels, 16)
    with pytest.raises(ValueError, match="must be int8"):
        int8_matmul.matmul(jnp.zeros((2, 64), jnp.float32), panels, 16)


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_each_build_gives_the_exact_sums(name, tmp_path_factory):
    target, _ = runnable_build(name, tmp_path_factory, "int8_matmul.cc", {"": "JpagedInt8Matmul"})
    rng = np.random.default_rng(11)
    for m, k, n, rows in [(5, 64, 40, 3), (40, 576, 33, 37), (64, 128, 16, 64)]:
        x, w = _operands(rng, 2, m, k, n)
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((m, n), jnp.int32))
        got = np.asarray(
            call(
                jnp.asarray(x),
                int8_matmul.pack(jnp.asarray(w)),
                jnp.ones(1, jnp.int32),
                jnp.full(1, rows, jnp.int32),
            )
        )
        np.testing.assert_array_equal(got[:rows], _exact(x[:rows], w[1]))
        assert not got[rows:].any()
