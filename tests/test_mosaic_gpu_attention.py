"""The Mosaic GPU attention kernel (jpaged/pallas/mosaic_gpu.py): in JAX's GPU interpret mode against the float64
oracle, with the interpreter's race detector on; exported for cuda on an abstract H100; and the choice between it
and the Triton kernel.

GPU interpret mode simulates shared memory, barriers, TMA copies and wgmma on the CPU. jax 0.10's interpreter cannot
read a transposed wgmma operand (the kernel's `k.T`), so the interpret-mode tests run under jax >= 0.11: .ci/run
runs this file again in its jax 0.11 venv. The exports and the choice run under both.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from lowering import TRITON_CALL, abstract_gpu, export_text
from numpy_attention import ragged_paged_attention_numpy
from test_pallas_attention import Bucket, Config, device_args, draw_step, fp8_pages, relative_error, sm_scale
from test_pallas_lowering import step_shapes

from jpaged.pallas import get_attention_fn, gpu_kernel_for, mosaic_gpu, query_tiles, resolve_attention_impl

MOSAIC_GPU_CALL = mosaic_gpu.KERNEL_CALL
JAX_VERSION = tuple(int(part) for part in jax.__version__.split(".")[:2])
needs_transposing_interpreter = pytest.mark.skipif(
    JAX_VERSION < (0, 11),
    reason="jax 0.10's GPU interpreter cannot transpose a wgmma operand; .ci/run's jax 0.11 venv runs this",
)
TOLERANCE = 1e-2  # bfloat16 / float16 inputs, p rounded to 16 bits for its wgmma

MIX = Bucket(num_tokens=48, num_seq_slots=4, max_q_len=30, max_context=100)
DECODE = Bucket(num_tokens=8, num_seq_slots=8, max_q_len=1, max_context=200)
CONFIGS = [
    Config("mosaic", "bfloat16", 16, 2, 4, 64, MIX),
    Config("mosaic", "bfloat16", 16, 3, 3, 64, MIX),  # SmolLM2's heads: 21 tokens a tile, one row unused
    Config("mosaic", "float16", 32, 2, 1, 64, DECODE, sliding_window=40, soft_cap=2.0),
    Config("mosaic", "bfloat16", 8, 1, 8, 128, DECODE),  # eight pages a step
    Config("mosaic", "bfloat16", 64, 2, 2, 64, MIX, sliding_window=40),  # one page a step
    Config("mosaic", "bfloat16", 128, 1, 2, 64, DECODE),  # a page longer than 64 keys: one page a step
    Config("mosaic", "bfloat16", 16, 1, 4, 256, MIX, soft_cap=5.0),  # Gemma's head size
]


def interpreted(fn):
    """`fn`'s result with the race detector reset before and read after: a race fails the test."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
        get_races,
        reset_gpu_interpret_mode_state,
    )

    reset_gpu_interpret_mode_state()
    result = jax.block_until_ready(fn())
    assert not get_races().races_found, "the GPU interpreter detected a race"
    return result


@functools.cache
def kernel_fn(cfg: Config, arch: str = "hopper"):
    options = dict(
        sm_scale=sm_scale(cfg), sliding_window=cfg.sliding_window, logits_soft_cap=cfg.soft_cap, arch=arch
    )

    def run(q, k_pages, v_pages, *metadata, sinks=None):
        return mosaic_gpu.ragged_paged_attention(
            q, k_pages, v_pages, *metadata, **options, sinks=sinks, interpret=True
        )

    return jax.jit(run)


def oracle(cfg: Config, args, sinks=None) -> np.ndarray:
    host = [np.asarray(a.astype(jnp.float32)) if a.dtype != jnp.int32 else np.asarray(a) for a in args]
    return ragged_paged_attention_numpy(
        *host,
        sm_scale=sm_scale(cfg),
        sliding_window=cfg.sliding_window,
        logits_soft_cap=cfg.soft_cap,
        sinks=sinks,
    )


def run(cfg: Config, args, sinks=None, arch: str = "hopper") -> np.ndarray:
    out = interpreted(
        lambda: kernel_fn(cfg, arch)(*args, sinks=None if sinks is None else jnp.asarray(sinks))
    )
    return np.asarray(out.astype(jnp.float32))


BLACKWELL_CONFIGS = [
    CONFIGS[1],
    CONFIGS[2],
    CONFIGS[3],
    CONFIGS[6],
]  # 128-row tiles: G 3, 1, 8; D 64, 128, 256
ARCH_CASES = [("hopper", c) for c in CONFIGS] + [("blackwell", c) for c in BLACKWELL_CONFIGS]


@needs_transposing_interpreter
@pytest.mark.parametrize(("arch", "cfg"), ARCH_CASES, ids=[f"{a}-{c.id}" for a, c in ARCH_CASES])
def test_kernel_matches_float64_numpy_on_random_ragged_steps(arch, cfg):
    """Hopper's products (wgmma, 64-row tiles) and Blackwell's (tcgen05 into tensor memory, 128-row tiles)."""
    rng = np.random.default_rng(zlib.crc32(cfg.id.encode()))
    for _ in range(2):
        step = draw_step(rng, cfg)
        args = device_args(step, cfg.dtype)
        out = run(cfg, args, arch=arch)
        real_rows = int(step["query_start"][step["num_seqs"][0]])
        assert np.isfinite(out).all() and not out[real_rows:].any(), "padding rows must be zero"
        assert relative_error(out, oracle(cfg, args), step) < TOLERANCE


@needs_transposing_interpreter
@pytest.mark.parametrize(("arch", "num_splits"), [("hopper", 2), ("hopper", 4), ("blackwell", 2)])
def test_split_kv_decode_matches_float64_numpy(arch, num_splits):
    """Each sequence's KV range split `num_splits` ways (some splits see no key at all; the sinks join the first
    split's softmax only) and combined; stale NaN in the cache and bucket padding as elsewhere."""
    cfg = Config("mosaic", "bfloat16", 16, 2, 4, 64, DECODE, sliding_window=150)
    rng = np.random.default_rng(zlib.crc32(f"split-{num_splits}".encode()))
    options = dict(
        sm_scale=sm_scale(cfg), sliding_window=cfg.sliding_window, num_splits=num_splits, arch=arch
    )
    kernel = jax.jit(functools.partial(mosaic_gpu.ragged_paged_attention, **options, interpret=True))
    sinks = rng.normal(1.0, 2.0, cfg.num_kv_heads * cfg.group).astype(np.float32)
    for stale in (None, np.nan):
        step = draw_step(rng, cfg, stale_value=stale)
        args = device_args(step, cfg.dtype)
        out = np.asarray(interpreted(lambda a=args: kernel(*a, sinks=jnp.asarray(sinks))).astype(jnp.float32))
        assert np.isfinite(out).all()
        assert relative_error(out, oracle(cfg, args, sinks=sinks), step) < TOLERANCE


@needs_transposing_interpreter
@pytest.mark.parametrize(("arch", "num_splits"), [("hopper", 1), ("hopper", 2), ("blackwell", 1)])
def test_fp8_pages_read_as_their_values_times_the_scales(arch, num_splits):
    """float8_e4m3fn pages (`--kv-cache-dtype fp8`) under bfloat16 queries, quantised with K and V scales and widened
    in shared memory for wgmma: the float64 oracle of the dequantised pages; stale NaN planted as elsewhere."""
    cfg = Config("mosaic", "bfloat16", 16, 2, 4, 64, MIX if num_splits == 1 else DECODE)
    rng = np.random.default_rng(zlib.crc32(f"fp8-{num_splits}".encode()))
    step = draw_step(rng, cfg, stale_value=np.nan)
    q, _, _, *metadata = device_args(step, cfg.dtype)
    k_scale, v_scale = 0.05, 3.0
    k_pages, k_values = fp8_pages(step["k_pages"] * k_scale, np.float32(k_scale))
    v_pages, v_values = fp8_pages(step["v_pages"] * v_scale, np.float32(v_scale))
    kernel = functools.partial(
        mosaic_gpu.ragged_paged_attention,
        sm_scale=sm_scale(cfg),
        k_scale=k_scale,
        v_scale=v_scale,
        num_splits=num_splits,
        arch=arch,
        interpret=True,
    )
    out = np.asarray(interpreted(lambda: jax.jit(kernel)(q, k_pages, v_pages, *metadata)).astype(jnp.float32))
    host = [np.asarray(q.astype(jnp.float32)), k_values, v_values, *map(np.asarray, metadata)]
    expected = ragged_paged_attention_numpy(*host, sm_scale=sm_scale(cfg))
    assert np.isfinite(out).all()
    assert relative_error(out, expected, step) < TOLERANCE


@needs_transposing_interpreter
def test_stale_nan_in_unowned_cache_slots_never_reaches_the_output():
    """Whole pages past a sequence's end, and the tails of partial ones, are copied in: none may leak."""
    cfg = CONFIGS[0]
    step = draw_step(np.random.default_rng(3), cfg, stale_value=np.nan)
    args = device_args(step, cfg.dtype)
    out = run(cfg, args)
    assert np.isfinite(out).all()
    assert relative_error(out, oracle(cfg, args), step) < TOLERANCE


@needs_transposing_interpreter
def test_step_without_sequences_gives_zeros():
    """What warm-up's dummy runs send: no live sequence, every tile exits at once."""
    cfg = CONFIGS[0]
    step = draw_step(np.random.default_rng(4), cfg)
    step["num_seqs"][:] = 0
    assert not run(cfg, device_args(step, cfg.dtype)).any()


@needs_transposing_interpreter
def test_sinks_join_each_rows_softmax():
    cfg = CONFIGS[1]
    rng = np.random.default_rng(6)
    step = draw_step(rng, cfg)
    args = device_args(step, cfg.dtype)
    sinks = rng.normal(1.0, 2.0, cfg.num_kv_heads * cfg.group).astype(np.float32)
    out = run(cfg, args, sinks=sinks)
    assert relative_error(out, oracle(cfg, args, sinks=sinks), step) < TOLERANCE


@needs_transposing_interpreter
def test_one_program_serves_each_layers_window_and_scales_and_reads_only_its_layer():
    """A stacked cache of two layers, the layer, window and KV scales traced: layer 1 read, layer 0 (a decoy that
    would dominate any softmax it leaked into) never; a window <= 0 is none."""
    cfg = Config("mosaic", "bfloat16", 16, 2, 2, 64, MIX)
    step = draw_step(np.random.default_rng(8), cfg)
    q, k_pages, v_pages, *metadata = device_args(step, cfg.dtype)
    decoy = jnp.full_like(k_pages, 100.0)
    k_cache, v_cache = jnp.stack([decoy, k_pages * 2]), jnp.stack([decoy, v_pages * 4])

    @jax.jit
    def attend(layer, window, k_scale, v_scale):
        return mosaic_gpu.ragged_paged_attention_stacked(
            q, k_cache, v_cache, layer, *metadata, sm_scale=sm_scale(cfg), sliding_window=window,
            k_scale=k_scale, v_scale=v_scale, interpret=True,
        )  # fmt: skip

    scales = (jnp.float32(0.5), jnp.float32(0.25))
    for window in (40, 0):
        out = interpreted(lambda w=window: attend(jnp.int32(1), jnp.int32(w), *scales))
        expected = oracle(
            Config("mosaic", "bfloat16", 16, 2, 2, 64, MIX, sliding_window=window or None),
            [q, k_pages, v_pages, *metadata],
        )
        assert relative_error(np.asarray(out.astype(jnp.float32)), expected, step) < TOLERANCE
    assert attend._cache_size() == 1


@needs_transposing_interpreter
def test_the_race_detector_is_on_so_the_checks_above_can_fail():
    """A kernel that reads shared memory without waiting for the copy into it: the interpreter reports the race."""

    def racy(x_ref, o_ref, smem, barrier):
        plgpu.copy_gmem_to_smem(x_ref, smem, barrier)
        smem[...] = smem[...] + 1.0  # not waited for
        plgpu.barrier_wait(barrier)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, o_ref)
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        racy,
        out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32),
        scratch_types=[plgpu.SMEM((64, 64), jnp.float32), plgpu.Barrier()],
        interpret=mosaic_gpu.interpret_params(),
    )
    with pytest.raises(AssertionError, match="race"):
        interpreted(lambda: kernel(jnp.zeros((64, 64), jnp.float32)))


H100 = "9.0"
EXPORTED_MODELS = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128), "gemma2-2b": (8, 4, 256)}


GPUS = {"hopper": abstract_gpu("NVIDIA H100 80GB HBM3"), "blackwell": abstract_gpu("NVIDIA B200")}


@pytest.mark.parametrize("arch", list(GPUS))
@pytest.mark.parametrize("bucket", ["decode", "decode-few", "prefill"])
@pytest.mark.parametrize("model", list(EXPORTED_MODELS))
def test_kernel_lowers_to_mosaic_gpu_for_cuda(model, bucket, arch):
    """On an abstract H100 with Hopper's products, a B200 with Blackwell's; "decode-few" (8 sequences) splits each
    KV range (split_kv.choose_num_splits). Mosaic GPU compiles for the real device's architecture when XLA compiles
    the exported program, so this checks the lowering, not sm_90a's or sm_100a's code generation."""
    options = dict(sm_scale=0.125, sliding_window=1024, logits_soft_cap=30.0, arch=arch)
    fn = functools.partial(mosaic_gpu.ragged_paged_attention, **options)
    text = export_text(fn, "cuda", step_shapes(bucket, EXPORTED_MODELS[model], jnp.bfloat16), GPUS[arch])
    assert MOSAIC_GPU_CALL in text and TRITON_CALL not in text


@pytest.mark.parametrize("bucket", ["decode-few", "prefill"])
def test_kernel_lowers_over_fp8_pages_for_cuda(bucket):
    q, k_pages, v_pages, *metadata = step_shapes(bucket, EXPORTED_MODELS["llama3-8b"], jnp.bfloat16)
    fp8 = jax.ShapeDtypeStruct(k_pages.shape, jnp.float8_e4m3fn)
    fn = functools.partial(mosaic_gpu.ragged_paged_attention, sm_scale=0.125, k_scale=0.5, v_scale=2.0)
    assert MOSAIC_GPU_CALL in export_text(fn, "cuda", [q, fp8, fp8, *metadata])


def test_kernel_lowers_with_layer_window_scales_and_sinks_as_data():
    shapes = step_shapes("decode-few", EXPORTED_MODELS["llama3-8b"], jnp.bfloat16)
    q, k_pages, v_pages, *metadata = shapes
    stacked = [jax.ShapeDtypeStruct((4, *k_pages.shape), k_pages.dtype)] * 2
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype)  # noqa: E731
    sinks = jax.ShapeDtypeStruct((q.shape[1],), jnp.float32)

    def fn(q, k, v, layer, window, k_scale, v_scale, sinks, *metadata):
        return mosaic_gpu.ragged_paged_attention_stacked(
            q, k, v, layer, *metadata, sm_scale=0.1, sliding_window=window, k_scale=k_scale, v_scale=v_scale,
            sinks=sinks,
        )  # fmt: skip

    args = [
        q,
        *stacked,
        scalar(jnp.int32),
        scalar(jnp.int32),
        scalar(jnp.float32),
        scalar(jnp.float32),
        sinks,
    ]
    assert MOSAIC_GPU_CALL in export_text(fn, "cuda", [*args, *metadata])


@pytest.mark.parametrize(
    ("capability", "layout", "expected", "why"),
    [
        (H100, (9, 3, 16, 64, jnp.bfloat16), "mosaic_gpu", "hopper's products"),
        ("10.0", (9, 3, 16, 64, jnp.bfloat16), "mosaic_gpu", "blackwell's products"),  # B200: tcgen05
        ("8.0", (9, 3, 16, 64, jnp.bfloat16), "triton", "capability 8.0 lacks"),  # Ampere
        ("12.0", (9, 3, 16, 64, jnp.bfloat16), "triton", "capability 12.0 lacks"),  # consumer Blackwell
        (H100, (32, 32, 16, 80, jnp.bfloat16), "triton", "multiple of 64"),  # Phi-2's heads
        (H100, (8, 4, 16, 128, jnp.float32), "triton", "bfloat16 or float16"),
        (H100, (8, 4, 16, 128, jnp.bfloat16, jnp.float8_e4m3fn), "mosaic_gpu", "hopper's products"),
        (H100, (8, 4, 16, 128, jnp.float32, jnp.float8_e4m3fn), "triton", "bfloat16 or float16"),
        (H100, (8, 4, 128, 256, jnp.bfloat16), "triton", "shared memory"),  # two stages of 128 x 256 pages
    ],
    ids=[
        "hopper",
        "blackwell",
        "ampere",
        "consumer-blackwell",
        "head-dim-80",
        "float32",
        "fp8-pages",
        "fp8-pages-under-float32",
        "pages-past-shared-memory",
    ],
)
def test_pallas_on_a_gpu_takes_mosaic_gpu_where_its_tiles_fit_and_says_why_not(
    capability, layout, expected, why
):
    num_q_heads, num_kv_heads, block_size, head_dim, dtype, *kv_dtype = layout
    kernel, reason = gpu_kernel_for(
        capability,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        head_dim=head_dim,
        dtype=dtype,
        kv_dtype=kv_dtype[0] if kv_dtype else None,
    )
    assert kernel == expected and why in reason


def test_each_gpu_kernel_can_be_named_and_runs_in_interpret_mode_on_cpu():
    for impl in ("mosaic_gpu", "triton"):
        assert resolve_attention_impl(impl, head_dim=64, dtype=jnp.bfloat16, backend="gpu") == impl
        with pytest.raises(ValueError, match="GPU kernel"):
            resolve_attention_impl(impl, head_dim=64, dtype=jnp.bfloat16, backend="tpu")
    fn = get_attention_fn("mosaic_gpu", num_kv_heads=2, block_size=16, head_dim=64, dtype=jnp.bfloat16)
    assert fn.func is mosaic_gpu.ragged_paged_attention_stacked and fn.keywords["interpret"]


def test_the_engine_imports_and_picks_mosaic_gpu_where_jax_has_no_triton_backend():
    """jax 0.11 deprecates Pallas' Triton backend: with its import failing, the engine still imports and its GPU
    attention on Hopper is the Mosaic GPU kernel (the whole step's export with it: test_step_program.py)."""
    pytest.importorskip("flax")  # the engine's own dependencies (the jax 0.11 venv has jax and numpy only)
    script = (
        "import sys; sys.modules['jax.experimental.pallas.triton'] = None\n"
        "import jpaged.runner.model_runner, jpaged.engine.llm_engine\n"
        "import jax.numpy as jnp\n"
        "from jpaged.pallas import gpu_kernel_for, _pallas_kernel\n"
        "kernel, _ = gpu_kernel_for('9.0', num_q_heads=9, num_kv_heads=3, block_size=16, head_dim=64, dtype=jnp.bfloat16)\n"
        "print(kernel, _pallas_kernel(kernel).__module__)\n"
        "try:\n    import jpaged.pallas.gpu\nexcept ImportError:\n    print('no triton')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["mosaic_gpu", "jpaged.pallas.mosaic_gpu", "no", "triton"]


def test_tiles_cover_every_query_row_once():
    """XLA's tile map: each live token's rows sit in exactly one tile of its own sequence."""
    query_start = jnp.array(
        [0, 5, 5, 30, 31, 31], jnp.int32
    )  # an empty sequence, a one-token one, a padding slot
    num_seqs = jnp.array([4], jnp.int32)
    tile_tokens = 8
    num_tiles = pl.cdiv(40, tile_tokens) + 5
    tile_seq, tile_first = (
        np.asarray(a) for a in query_tiles.tile_map(query_start, num_seqs, tile_tokens, num_tiles)
    )
    covered = sorted(
        (int(s), int(f) + i)
        for s, f in zip(tile_seq, tile_first, strict=True)
        if s >= 0
        for i in range(tile_tokens)
    )
    lengths = np.diff(np.asarray(query_start))[:4]
    expected = [(s, t) for s in range(4) for t in range(int(np.ceil(lengths[s] / tile_tokens)) * tile_tokens)]
    assert covered == expected
