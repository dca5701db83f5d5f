"""The C++ CPU matmul kernel (cpu_matmul) against a float64 numpy oracle on fresh random shapes: panels that do not
fill their 16 columns, any K, live rows fewer than the padded batch, one layer picked from a stack."""

from __future__ import annotations

import ctypes
import functools
import itertools
import platform
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.models.activations import act_and_mul
from jpaged.pallas.cpu import library
from jpaged.pallas.cpu import matmul as cpu_matmul

TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}
# (M, K, N); K 2304 and 9216: Gemma 2 2B's hidden and MLP sizes
SHAPES = [
    (1, 8, 1),
    (7, 40, 24),
    (16, 576, 960),
    (13, 1536, 576),
    (64, 100, 33),
    (512, 64, 50),
    (5, 2304, 40),
]
SHAPES += [(3, 9216, 24)]


def _relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    """The largest difference from float64 numpy, relative to the largest expected magnitude."""
    return float(np.abs(got - expected).max() / np.abs(expected).max())


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
    got = _matmul(x, cpu_matmul.kernel_panels(w), layer, rows, n=n, out_dtype=out_dtype)
    assert got.shape == (m, n) and got.dtype == (jnp.float32 if out_float32 else x.dtype)
    expected = np.asarray(x, np.float64)[:rows] @ np.asarray(w, np.float64)[layer]
    got = np.asarray(got, np.float64)
    assert _relative_error(got[:rows], expected) <= TOLERANCE[dtype]
    assert not got[rows:].any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_rows_result_does_not_depend_on_the_other_rows(dtype):
    """Same bits whatever the batch around a row: bucket size, live row count, neighbours (a bfloat16 panel
    is read as it is by one row block and through its float32 widening by several)."""
    rng = np.random.default_rng(7)
    panels = cpu_matmul.kernel_panels(jnp.asarray(rng.standard_normal((1, 300, 70)), dtype))
    x = jnp.asarray(rng.standard_normal((64, 300)), dtype)
    full = np.asarray(_matmul(x, panels, 0, 64, n=70).astype(jnp.float32))
    for m, rows in [(64, 11), (16, 16), (8, 5), (1, 1)]:
        shuffled = x[:m].at[rows:].set(jnp.asarray(rng.standard_normal((m - rows, 300)), dtype))
        np.testing.assert_array_equal(
            np.asarray(_matmul(shuffled, panels, 0, rows, n=70).astype(jnp.float32))[:rows], full[:rows]
        )


# Builds that take paths -march=native may not take here: AVX2's eight-lane blocks, AVX-512 without BF16 (bfloat16
# panels widened in registers), AVX-512-BF16 without AMX (vdpbf16ps), and the AMX tiles, run on a model of their instructions (tests/amx_model.h) where
# the CPU has none: (march, extra flags, the CPU flags its code needs).
AVX512 = {"avx2", "fma", "bmi2", "movbe", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
BUILDS = {
    "x86-64-v3": ("x86-64-v3", (), {"avx2", "fma", "bmi2", "movbe"}),
    "x86-64-v4": ("x86-64-v4", (), AVX512),
    "avx512-bf16": ("cooperlake", (), AVX512 | {"avx512_bf16"}),
    "amx-model": ("native", ("-DJPAGED_AMX_MODEL", f"-I{Path(__file__).parent}"), AVX512 | {"avx512_bf16"}),
    "amx": ("sapphirerapids", (), AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}),
}


MATMUL_SYMBOLS = {"": "JpagedMatmul", "_gated": "JpagedMatmulGated"}


@functools.cache
def _build(name: str, tmp: str, source: str, symbols: tuple, defines: tuple) -> tuple[str, ctypes.CDLL]:
    """The kernel in `source` built as BUILDS[name] says (with `defines`: a form of the grouped kernel), its
    `symbols` ((target suffix, handler)...) registered with XLA under targets of their own."""
    march, extra, _ = BUILDS[name]
    form = "_".join(d.split("=")[-1] for d in defines)
    stem = f"{Path(source).stem}-{name}-{form}".replace(" ", "")
    built = Path(tmp) / f"{stem}.so"
    source_path = Path(cpu_matmul.__file__).with_name(source)
    library.compile_sources([source_path], built, march=march, extra=(*extra, *defines))
    target = "jpaged_" + "".join(c if c.isalnum() else "_" for c in stem)
    return target, library.register(built, {target + suffix: symbol for suffix, symbol in symbols})


def runnable_build(
    name: str,
    tmp_path_factory,
    source: str = "matmul.cc",
    symbols: dict[str, str] = MATMUL_SYMBOLS,
    defines: tuple[str, ...] = (),
) -> tuple[str, ctypes.CDLL]:
    if platform.machine() != "x86_64" or not BUILDS[name][2] <= library.cpu_flags():
        pytest.skip(f"this CPU does not run the {name} build")
    return _build(name, str(tmp_path_factory.getbasetemp()), source, tuple(symbols.items()), defines)


def _build_panels(name: str, w: jax.Array, *, gated: bool = False) -> jax.Array:
    """w's panels as build `name` reads them: bfloat16 of an even K paired where it multiplies with vdpbf16ps."""
    paired = "avx512_bf16" in BUILDS[name][2] and w.dtype == jnp.bfloat16 and w.shape[-2] % 2 == 0
    return (cpu_matmul.pack_gated if gated else cpu_matmul.pack)(w, paired=paired)


def _call(target: str, x: jax.Array, panels: jax.Array, n: int, rows: int, dtype=jnp.float32) -> np.ndarray:
    """Layer 1 of the panels' stack, as `dtype`."""
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), dtype))
    return np.asarray(call(x, panels, jnp.ones(1, jnp.int32), jnp.full(1, rows, jnp.int32)))


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_each_build_matches_float64_numpy(name, tmp_path_factory):
    target, _ = runnable_build(name, tmp_path_factory)
    rng = np.random.default_rng(11)
    # (M, K, N, rows): K 64, 576 and 1536 fill whole tiles of 32, 37 does not (vdpbf16ps in the AMX builds); 37
    # rows end in a smaller row group (16 + 5) than the first two (16 + 16); 33 columns end in an item of one
    # panel, one column wide.
    shapes = [(5, 37, 40, 3), (64, 576, 70, 64), (20, 1536, 16, 20), (40, 64, 33, 37)]
    for (m, k, n, rows), dtype in itertools.product(shapes, TOLERANCE):
        w = jnp.asarray(rng.standard_normal((2, k, n)), dtype)
        x = jnp.asarray(rng.standard_normal((m, k)), dtype)
        got = _call(target, x, _build_panels(name, w), n, rows)
        expected = np.asarray(x, np.float64)[:rows] @ np.asarray(w, np.float64)[1]
        assert _relative_error(got[:rows], expected) <= TOLERANCE[dtype], (m, k, n, dtype)
        assert not got[rows:].any()
    # The gated form, gate and up f wide, in x's dtype (its sums rounded to it).
    for (m, k, f, rows), dtype in itertools.product(
        [(5, 37, 16, 3), (64, 576, 48, 64), (40, 64, 32, 37)], TOLERANCE
    ):
        w = jnp.asarray(rng.standard_normal((2, k, 2 * f)) / np.sqrt(k), dtype)
        x = jnp.asarray(rng.standard_normal((m, k)), dtype)
        got = _call(f"{target}_gated", x, _build_panels(name, w, gated=True), f, rows, x.dtype)
        got = np.asarray(got, np.float64)
        expected = _silu_and_mul_float64(x[:rows], w[1])
        assert _relative_error(got[:rows], expected) <= 3 * TOLERANCE[dtype], ("gated", m, k, f, dtype)
        assert not got[rows:].any()


def test_the_amx_tiles_take_bfloat16_products_whatever_the_rows(tmp_path_factory):
    """On the model of the tiles: the tile path runs (its dot products counted), says so to dtype="auto", and
    gives a row the same bits in a batch of 64 rows as in one of 1, 11 or 17."""
    target, handle = runnable_build("amx-model", tmp_path_factory)
    _, arithmetic = runnable_build("amx-model", tmp_path_factory, "common.cc", {})
    arithmetic.JpagedBfloat16Arithmetic.restype = ctypes.c_char_p
    assert arithmetic.JpagedBfloat16Arithmetic() == b"amx_bf16"
    handle.JpagedAmxModelDots.restype = ctypes.c_int64
    rng = np.random.default_rng(5)
    panels = _build_panels("amx-model", jnp.asarray(rng.standard_normal((2, 128, 40)), jnp.bfloat16))
    x = jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16)
    dots = handle.JpagedAmxModelDots()
    full = _call(target, x, panels, 40, 64)
    # 4 tiles of k x 2 row groups (of 16 + 16 rows) x (an item of two panels, 2 x 2 products, + one of one)
    assert handle.JpagedAmxModelDots() - dots == 4 * 2 * (2 * 2 + 2 * 1)
    for rows in (1, 11, 17):
        np.testing.assert_array_equal(_call(target, x[:32], panels, 40, rows)[:rows], full[:rows])


def test_the_amx_build_multiplies_on_the_tiles(tmp_path):
    """Where no CPU here runs it, the build for Sapphire Rapids still compiles, with the tile instructions in."""
    if platform.machine() != "x86_64" or shutil.which("objdump") is None:
        pytest.skip("needs x86-64 and objdump")
    built = tmp_path / "matmul-amx.so"
    library.compile_sources([Path(cpu_matmul.__file__).with_name("matmul.cc")], built, march="sapphirerapids")
    code = subprocess.run(["objdump", "-d", str(built)], capture_output=True, text=True, check=True).stdout
    assert {"sttilecfg", "ldtilecfg", "tileloadd", "tdpbf16ps", "tilestored"} <= set(code.split())


@jax.jit(static_argnames=("n",))
def _gated(x, panels, layer, rows, *, n):
    return cpu_matmul.gated_matmul(x, panels, n, layer=layer, rows=rows)


def _silu_and_mul_float64(x, w):
    h = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    gate, up = np.split(h, 2, axis=-1)
    return gate / (1 + np.exp(-gate)) * up


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("m", "k", "f"), [(1, 8, 16), (7, 40, 48), (64, 576, 1536), (512, 64, 32)], ids=str)
def test_the_gated_form_gives_silu_of_gate_times_up_in_float64_numpy(m, k, f, dtype):
    rng = np.random.default_rng([m, k, f])
    w = jnp.asarray(rng.standard_normal((3, k, 2 * f)) / np.sqrt(k), dtype)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    layer, rows = int(rng.integers(0, 3)), int(rng.integers(1, m + 1))
    got = _gated(x, cpu_matmul.kernel_panels(w, gated=True), layer, rows, n=f)
    assert got.shape == (m, f) and got.dtype == x.dtype
    expected = _silu_and_mul_float64(x[:rows], w[layer])
    got = np.asarray(got, np.float64)
    # bfloat16: gate, up and the activation each rounded to bfloat16, as the unfused product and XLA round them
    assert _relative_error(got[:rows], expected) <= 3 * TOLERANCE[dtype]
    assert not got[rows:].any()


def test_the_gated_form_gives_the_unfused_products_bits_in_bfloat16():
    """The same bits as the [M, 2F] product followed by products.py's act_and_mul (XLA's activation), so the
    engine's bfloat16 output does not depend on which of the two it took."""
    rng = np.random.default_rng(9)
    w = jnp.asarray(rng.standard_normal((1, 576, 2 * 1536)) / 24, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((64, 576)), jnp.bfloat16)
    unfused = act_and_mul(_matmul(x, cpu_matmul.kernel_panels(w), 0, 50, n=2 * 1536), (1536, 1536), 1)
    np.testing.assert_array_equal(
        np.asarray(_gated(x, cpu_matmul.kernel_panels(w, gated=True), 0, 50, n=1536), np.float32),
        np.asarray(unfused, np.float32),
    )


def test_gated_packing_alternates_gate_and_up_panels():
    w = jnp.asarray(np.random.default_rng(3).standard_normal((2, 5, 64)), jnp.float32)
    panels = cpu_matmul.pack_gated(w)
    assert panels.shape == (2, 4, 5, 16)
    for i, columns in enumerate([range(0, 16), range(32, 48), range(16, 32), range(48, 64)]):
        np.testing.assert_array_equal(panels[:, i], w[:, :, list(columns)])
    with pytest.raises(ValueError, match="multiples of 16"):
        cpu_matmul.pack_gated(jnp.zeros((5, 40)))


def test_packing_keeps_every_column_and_pads_with_zeros():
    w = jnp.asarray(np.random.default_rng(3).standard_normal((2, 5, 37)), jnp.float32)
    panels = cpu_matmul.pack(w)
    assert panels.shape == (2, 3, 5, 16)
    ids = jnp.asarray([0, 15, 16, 36, 7], jnp.int32)
    np.testing.assert_array_equal(cpu_matmul.columns(panels[1], ids), w[1][:, ids].T)
    assert not np.asarray(panels)[:, 2, :, 5:].any()


@pytest.mark.parametrize("host", [False, True])
def test_paired_panels_interleave_rows_k_and_k_plus_one_of_each_column(host):
    w = np.random.default_rng(4).standard_normal((2, 6, 70)).astype(np.float32)
    w = w if host else jnp.asarray(w)
    plain, paired = cpu_matmul.pack(w), cpu_matmul.pack(w, paired=True)
    assert paired.shape == plain.shape == (2, 5, 6, 16)
    # [.., P, K, 16] in memory as [.., P, K / 2, 16, 2]: column c's rows 2i and 2i + 1 side by side
    as_pairs = np.asarray(paired).reshape(2, 5, 3, 16, 2)
    np.testing.assert_array_equal(as_pairs, np.asarray(plain).reshape(2, 5, 3, 2, 16).swapaxes(-1, -2))
    gated, gated_paired = cpu_matmul.pack_gated(w[..., :64]), cpu_matmul.pack_gated(w[..., :64], paired=True)
    np.testing.assert_array_equal(
        np.asarray(gated_paired).reshape(2, 4, 3, 16, 2),
        np.asarray(gated).reshape(2, 4, 3, 2, 16).swapaxes(-1, -2),
    )


def test_the_kernels_panels_give_back_a_tied_embeddings_rows():
    """`columns` reads rows of the embedding from the LM head's panels as the kernel built here lays them out
    (bfloat16 paired where it multiplies with vdpbf16ps or the tiles)."""
    w = jnp.asarray(np.random.default_rng(6).standard_normal((64, 40)), jnp.bfloat16)
    panels = cpu_matmul.kernel_panels(w)
    paired = library.cpu_flags() >= {"avx512_bf16"} and library.compiles()
    assert cpu_matmul.pairs(w.dtype, 64) == paired
    ids = jnp.asarray([[0, 39], [17, 16]], jnp.int32)
    np.testing.assert_array_equal(cpu_matmul.columns(panels, ids), jnp.moveaxis(w[:, ids], 0, -1))


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


@pytest.mark.parametrize(
    ("x_shape", "x_dtype", "n", "message"),
    [
        ((4, 6), jnp.float32, 16, "do not make"),  # K 6 vs the panels' 5
        ((4, 5), jnp.float32, 32, "do not make"),  # the panels hold gate and up 16 wide, not 32
        ((4, 5), jnp.bfloat16, 16, "float32 or bfloat16"),  # dtype differs from the panels'
    ],
)
def test_bad_gated_input_raises_value_error(x_shape, x_dtype, n, message):
    panels = cpu_matmul.pack_gated(jnp.zeros((5, 32), jnp.float32))
    with pytest.raises(ValueError, match=message):
        cpu_matmul.gated_matmul(jnp.zeros(x_shape, x_dtype), panels, n)


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
        "from jpaged.pallas.cpu import library, matmul; library.require(library.COMMON); "
        "library.require(matmul.KERNEL); "
        "tiny = 2.2250738585072014e-308; assert tiny / 2 != 0.0, 'subnormals flushed to zero'"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_kernel_multiplies_bfloat16_natively_exactly_where_the_cpu_can():
    """Built with -march=native: the AMX tiles where /proc/cpuinfo lists them (and Linux grants them), else the
    AVX-512-BF16 dot products where it lists those, widening elsewhere (what dtype="auto" reads)."""
    flags = library.cpu_flags()
    expected = "avx512_bf16" if "avx512_bf16" in flags else None
    if {"amx_tile", "amx_bf16"} <= flags:
        expected = "amx_bf16"
    assert library.bfloat16_arithmetic() == expected
    assert library.bfloat16_dot_products() == expected  # what dtype="auto" reads before the build
