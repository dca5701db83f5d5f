"""The C++ CPU matmul kernel (cpu_matmul) against a float64 numpy oracle on fresh random shapes: panels that do not
fill their 16 columns, any K, live rows fewer than the padded batch, one layer picked from a stack."""

from __future__ import annotations

import functools
import itertools
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.pallas.cpu import library
from jpaged.pallas.cpu import matmul as cpu_matmul

TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}
SHAPES = [(1, 8, 1), (7, 40, 24), (16, 576, 960), (13, 1536, 576), (64, 100, 33), (512, 64, 50)]  # (M, K, N)


@jax.jit(static_argnames=("n", "out_dtype"))
def _matmul(x, panels, layer, rows, *, n, out_dtype=None):
    return cpu_matmul.matmul(x, panels, n, layer=layer, rows=rows, out_dtype=out_dtype)


@pytest.mark.parametrize("out_float32", [False, True], ids=["out-like-x", "out-f32"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES, ids=lambda v: str(v))
def test_live_rows_match_float64_numpy_and_the_rest_are_zero(m, k, n, dtype, out_float32):
    rng = np.random.default_rng([m, k, n])
    w = jnp.asarray(rng.standard_normal((3, k, n)), dtype)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    layer, rows = int(rng.integers(0, 3)), int(rng.integers(1, m + 1))
    out_dtype = jnp.float32 if out_float32 else None
    got = _matmul(x, cpu_matmul.pack(w), layer, rows, n=n, out_dtype=out_dtype)
    assert got.shape == (m, n) and got.dtype == (jnp.float32 if out_float32 else x.dtype)
    expected = np.asarray(x, np.float64)[:rows] @ np.asarray(w, np.float64)[layer]
    got = np.asarray(got, np.float64)
    assert np.abs(got[:rows] - expected).max() <= TOLERANCE[dtype] * np.abs(expected).max()
    assert not got[rows:].any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_rows_result_does_not_depend_on_the_other_rows(dtype):
    """Same bits whatever the batch around a row: bucket size, live row count, neighbours (a bfloat16 panel
    is read as it is by one row block and through its float32 widening by several)."""
    rng = np.random.default_rng(7)
    panels = cpu_matmul.pack(jnp.asarray(rng.standard_normal((1, 300, 70)), dtype))
    x = jnp.asarray(rng.standard_normal((64, 300)), dtype)
    full = np.asarray(_matmul(x, panels, 0, 64, n=70).astype(jnp.float32))
    for m, rows in [(64, 11), (16, 16), (8, 5), (1, 1)]:
        shuffled = x[:m].at[rows:].set(jnp.asarray(rng.standard_normal((m - rows, 300)), dtype))
        np.testing.assert_array_equal(
            np.asarray(_matmul(shuffled, panels, 0, rows, n=70).astype(jnp.float32))[:rows], full[:rows]
        )


# The x86-64 levels whose builds take paths -march=native may not take here: AVX2's eight-lane blocks, and AVX-512
# without BF16 (bfloat16 panels widened in registers); each needs its instructions on the CPU that runs the test.
X86_LEVELS = {
    "x86-64-v3": {"avx2", "fma", "bmi2", "movbe"},
    "x86-64-v4": {"avx2", "fma", "bmi2", "movbe", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"},
}


@functools.cache
def _level_target(march: str, tmp: str) -> str:
    """The matmul kernel built for `march` and registered with XLA under a target of its own."""
    built = Path(tmp) / f"matmul-{march}.so"
    library.compile_sources([Path(cpu_matmul.__file__).with_name("matmul.cc")], built, march=march)
    target = f"jpaged_matmul_{march.replace('-', '_')}"
    library.register(built, {target: "JpagedMatmul"})
    return target


@pytest.mark.parametrize("march", sorted(X86_LEVELS))
def test_the_kernel_built_for_each_x86_level_matches_float64_numpy(march, tmp_path_factory):
    if platform.machine() != "x86_64" or not X86_LEVELS[march] <= library.cpu_flags():
        pytest.skip(f"this CPU does not run {march} code")
    target = _level_target(march, str(tmp_path_factory.mktemp("kernels")))
    rng = np.random.default_rng(11)
    for (m, k, n), dtype in itertools.product([(5, 37, 40), (64, 576, 70), (20, 1536, 16)], TOLERANCE):
        w = jnp.asarray(rng.standard_normal((2, k, n)), dtype)
        x = jnp.asarray(rng.standard_normal((m, k)), dtype)
        rows = int(rng.integers(1, m + 1))
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((m, n), jnp.float32))
        got = np.asarray(call(x, cpu_matmul.pack(w), jnp.ones(1, jnp.int32), jnp.full(1, rows, jnp.int32)))
        expected = np.asarray(x, np.float64)[:rows] @ np.asarray(w, np.float64)[1]
        assert np.abs(got[:rows] - expected).max() <= TOLERANCE[dtype] * np.abs(expected).max(), (
            m,
            k,
            n,
            dtype,
        )
        assert not got[rows:].any()


def test_packing_keeps_every_column_and_pads_with_zeros():
    w = jnp.asarray(np.random.default_rng(3).standard_normal((2, 5, 37)), jnp.float32)
    panels = cpu_matmul.pack(w)
    assert panels.shape == (2, 3, 5, 16)
    ids = jnp.asarray([0, 15, 16, 36, 7], jnp.int32)
    np.testing.assert_array_equal(cpu_matmul.columns(panels[1], ids), w[1][:, ids].T)
    assert not np.asarray(panels)[:, 2, :, 5:].any()


@pytest.mark.parametrize(
    ("x_shape", "x_dtype", "n", "options", "message"),
    [
        ((4, 6), jnp.float32, 20, {}, "do not make"),  # K 6 vs the panels' 5
        ((4, 5), jnp.float32, 40, {}, "do not make"),  # 40 columns need 3 panels, not 2
        ((4, 5), jnp.bfloat16, 20, {}, "float32 or bfloat16"),  # dtype differs from the panels'
        ((4, 5), jnp.float32, 20, {"out_dtype": jnp.float16}, "out_dtype"),
    ],
)
def test_bad_input_raises_value_error_naming_the_field(x_shape, x_dtype, n, options, message):
    panels = cpu_matmul.pack(jnp.zeros((5, 20), jnp.float32))
    with pytest.raises(ValueError, match=message):
        cpu_matmul.matmul(jnp.zeros(x_shape, x_dtype), panels, n, **options)


def test_float16_is_not_taken():
    assert cpu_matmul.supports(jnp.float32) and cpu_matmul.supports(jnp.bfloat16)
    assert not cpu_matmul.supports(jnp.float16)


def test_loading_the_kernels_leaves_the_process_floating_point_state_alone():
    """A library linked with -ffast-math turns on flush-to-zero in the process that loads it (crtfastmath.o): no
    Python code after it could hold a subnormal float (hypothesis refuses to generate floats then). A fresh process,
    so that the load happens on the thread that checks."""
    import subprocess
    import sys

    check = (
        "from jpaged.pallas.cpu import library; library.require(); "
        "tiny = 2.2250738585072014e-308; assert tiny / 2 != 0.0, 'subnormals flushed to zero'"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_kernel_multiplies_bfloat16_natively_exactly_where_the_cpu_can():
    """Built with -march=native: the AVX-512-BF16 dot products where /proc/cpuinfo lists them, widening
    elsewhere (what dtype="auto" reads)."""
    expected = "avx512_bf16" if "avx512_bf16" in library.cpu_flags() else None
    assert library.bfloat16_arithmetic() == expected
