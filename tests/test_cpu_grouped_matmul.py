"""The C++ kernel for group-quantized matrices (cpu grouped_matmul) against a float64 numpy oracle and against XLA's
dequantise-then-dot (models.grouped), on fresh random codes: 4-bit codes two a byte and 8-bit ones (signed and
unsigned), float16 and float32 scales, groups of 32 and of 16, panels that do not fill their columns, live rows fewer
than the batch, one layer of a stack, the gated form, and the builds for other CPUs."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cpu_matmul import runnable_build

from jpaged.models.grouped import GroupedMatrix, GroupedProducts
from jpaged.pallas.cpu import grouped_matmul

# (bits, codes dtype, scale dtype, group size)
FORMATS = [
    (4, np.uint8, np.float16, 32),  # GGUF Q4_0 / Q4_1
    (8, np.int8, np.float16, 32),  # GGUF Q8_0
    (8, np.uint8, np.float32, 16),
    (4, np.uint8, np.float32, 128),  # AWQ / GPTQ's groups
]
FORMAT_IDS = ["q4-f16-g32", "s8-f16-g32", "u8-f32-g16", "q4-f32-g128"]


def random_grouped(rng, layers: int, k: int, n: int, fmt) -> GroupedMatrix:
    bits, code_dtype, scale_dtype, group = fmt
    info = np.iinfo(code_dtype)
    low, high = (0, 2**bits) if bits == 4 else (info.min, info.max + 1)
    codes = rng.integers(low, high, (layers, k, n)).astype(code_dtype)
    scale = (rng.uniform(0.5, 1.5, (layers, k // group, n)) / high).astype(scale_dtype)
    bias = (rng.standard_normal((layers, k // group, n)) * 0.1).astype(scale_dtype)
    return GroupedMatrix(codes, scale, bias, bits)


def oracle(x: jax.Array, matrix: GroupedMatrix, layer: int) -> np.ndarray:
    """x @ w in float64, w dequantised in float64 and rounded to x's dtype as the kernel's buffer holds it."""
    g = matrix.group_size
    w = matrix.codes[layer].astype(np.float64) * np.repeat(matrix.scale[layer], g, axis=0).astype(np.float64)
    w += np.repeat(matrix.bias[layer], g, axis=0).astype(np.float64)
    w = np.asarray(jnp.asarray(w.astype(np.float32), x.dtype), np.float64)
    return np.asarray(x, np.float64) @ w


def relative_error(got, expected) -> float:
    return float(np.abs(np.asarray(got, np.float64) - expected).max() / np.abs(expected).max())


@jax.jit(static_argnames=("n", "bits", "out_dtype"))
def _matmul(x, codes, scale, bias, layer, rows, *, n, bits, out_dtype=None):
    panels = grouped_matmul.pack(codes, scale, bias, bits=bits)
    return grouped_matmul.matmul(x, panels, n, layer=layer, rows=rows, out_dtype=out_dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize(
    ("m", "k", "n"), [(1, 128, 16), (7, 256, 40), (16, 576, 960), (40, 128, 33)], ids=str
)
def test_live_rows_match_float64_numpy_and_xla_and_the_rest_are_zero(m, k, n, fmt, dtype):
    rng = np.random.default_rng([m, k, n])
    matrix = random_grouped(rng, 3, k, n, fmt)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    layer, rows = int(rng.integers(0, 3)), int(rng.integers(1, m + 1))
    args = (x, matrix.codes, matrix.scale, matrix.bias, layer, rows)
    got = _matmul(*args, n=n, bits=fmt[0], out_dtype=jnp.float32)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    assert relative_error(got[:rows], oracle(x[:rows], matrix, layer)) < 1e-5
    assert not np.asarray(got)[rows:].any()
    one_layer = jax.tree_util.tree_map(lambda a: a[layer], matrix)
    xla = GroupedProducts().layer("o", one_layer, x, layer, rows)
    like_x = _matmul(*args, n=n, bits=fmt[0])
    assert like_x.dtype == x.dtype
    assert (
        relative_error(like_x[:rows], np.asarray(xla[:rows], np.float64))
        < 1e-5 + (dtype == "bfloat16") * 8e-3
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_gated_form_is_silu_of_gate_times_up_of_the_dequantised_matrix(dtype):
    rng = np.random.default_rng(3)
    f, k = 48, 128
    matrix = random_grouped(rng, 2, k, 2 * f, FORMATS[0])
    x = jnp.asarray(rng.standard_normal((9, k)), dtype)
    panels = grouped_matmul.pack(matrix.codes, matrix.scale, matrix.bias, bits=4, gated=True)
    got = grouped_matmul.gated_matmul(x, panels, f, layer=1, rows=6)
    h = oracle(x[:6], matrix, 1)
    gate, up = h[:, :f], h[:, f:]
    expected = gate / (1 + np.exp(-gate)) * up
    assert relative_error(got[:6], expected) < {"float32": 1e-5, "bfloat16": 3e-2}[dtype]
    assert not np.asarray(got[6:], np.float32).any()


def test_a_rows_result_does_not_depend_on_the_other_rows():
    rng = np.random.default_rng(7)
    matrix = random_grouped(rng, 1, 256, 70, FORMATS[0])
    x = jnp.asarray(rng.standard_normal((64, 256)), jnp.bfloat16)
    full = np.asarray(_matmul(x, matrix.codes, matrix.scale, matrix.bias, 0, 64, n=70, bits=4), np.float32)
    for m, rows in [(16, 16), (8, 5), (1, 1)]:
        got = _matmul(x[:m], matrix.codes, matrix.scale, matrix.bias, 0, rows, n=70, bits=4)
        np.testing.assert_array_equal(np.asarray(got, np.float32)[:rows], full[:rows])


def test_panels_hold_half_a_byte_a_weight_for_four_bit_codes():
    matrix = random_grouped(np.random.default_rng(1), 1, 64, 32, FORMATS[0])
    codes, scale, bias = grouped_matmul.pack(matrix.codes, matrix.scale, matrix.bias, bits=4)
    assert codes.shape == (1, 2, 32, 16) and codes.dtype == jnp.uint8
    assert scale.shape == bias.shape == (1, 2, 2, 16) and scale.dtype == jnp.float16
    assert codes.nbytes == matrix.codes.size // 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(k=100), "do not make a product"),
        (dict(scale_rows=3), "do not group codes"),
    ],
)
def test_shapes_that_do_not_agree_are_a_value_error(change, message):
    matrix = random_grouped(np.random.default_rng(2), 1, 64, 16, FORMATS[0])
    panels = grouped_matmul.pack(matrix.codes, matrix.scale, matrix.bias, bits=4)
    if "scale_rows" in change:
        three_groups = jnp.concatenate([panels[1][:, :, :1]] * 3, 2)  # 64 rows do not make 3 groups
        panels = (panels[0], three_groups, three_groups)
    x = jnp.ones((2, change.get("k", 64)), jnp.float32)
    with pytest.raises(ValueError, match=message):
        grouped_matmul.matmul(x, panels, 16)


SYMBOLS = {"": "JpagedGroupedMatmul", "_gated": "JpagedGroupedMatmulGated"}


# The builds whose paths differ here (AVX2's float32 buffer, AVX-512-BF16's pairs in registers and from a buffer, the
# tiles on their model): each is a compile of its own, so not every build of test_cpu_matmul.
# Two formats a build, whose paths differ (4-bit codes two a byte with float16 scales, 8-bit ones with float32
# scales), each form a compile of its own.
@pytest.mark.parametrize("name", ["x86-64-v3", "avx512-bf16", "amx-model"])
def test_each_build_matches_float64_numpy(name, tmp_path_factory):
    rng = np.random.default_rng(11)
    for (m, k, n, rows), fmt, dtype in itertools.product(
        [(5, 128, 40, 3), (40, 640, 33, 37)], [FORMATS[0], FORMATS[2]], ["float32", "bfloat16"]
    ):
        form = grouped_matmul.kernel(*fmt[:3], dtype, jnp.float32)
        target, _ = runnable_build(name, tmp_path_factory, "grouped_matmul.cc", SYMBOLS, form.defines)
        matrix = random_grouped(rng, 2, k, n, fmt)
        x = jnp.asarray(rng.standard_normal((m, k)), dtype)
        panels = grouped_matmul.pack(matrix.codes, matrix.scale, matrix.bias, bits=fmt[0])
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((m, n), jnp.float32))
        got = np.asarray(call(x, *panels, jnp.ones(1, jnp.int32), jnp.full(1, rows, jnp.int32)))
        assert relative_error(got[:rows], oracle(x[:rows], matrix, 1)) < 1e-5, (m, k, n, fmt, dtype)
        assert not got[rows:].any()
        # A row's bits whatever the batch: one row alone takes the decode-sized path (in registers, or on the
        # tiles one k-tile at a time), 37 rows the dequantised buffer.
        alone = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((1, n), jnp.float32))
        one = np.asarray(alone(x[:1], *panels, jnp.ones(1, jnp.int32), jnp.ones(1, jnp.int32)))
        np.testing.assert_array_equal(one[0], got[0])


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_host_weights_are_laid_out_by_numpy_as_the_jitted_layout_lays_them_out(fmt, gated):
    """A start-up lays out every weight: host arrays take numpy (no program compiled for each weight's shape),
    device arrays and traces the jitted form, to the same bits."""
    matrix = random_grouped(np.random.default_rng(4), 2, 256, 64, fmt)
    on_host = grouped_matmul.pack(matrix.codes, matrix.scale, matrix.bias, bits=fmt[0], gated=gated)
    arrays = (jnp.asarray(matrix.codes), jnp.asarray(matrix.scale), jnp.asarray(matrix.bias))
    jitted = grouped_matmul.pack(*arrays, bits=fmt[0], gated=gated)
    for host, device in zip(on_host, jitted, strict=True):
        assert isinstance(host, np.ndarray) and isinstance(device, jax.Array)
        assert host.dtype == device.dtype
        np.testing.assert_array_equal(host, np.asarray(device))
