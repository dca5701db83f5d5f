"""The ragged paged attention kernels against a float64 numpy oracle and the XLA reference, on fresh random steps:
ragged query lengths, partial last blocks, GQA, padding sequences and rows.

The GPU kernel runs under Pallas' generic interpreter; the TPU kernel under its TPU simulator (DMAs and
semaphores modelled, scratch filled with NaN); the C++ CPU kernel (cpu_attention) natively, built on first use.
Each static configuration compiles once and sees several draws.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from numpy_attention import ragged_paged_attention_numpy

from jpaged.pallas import gpu, ragged_paged_attention, tpu
from jpaged.pallas.cpu import attention as cpu
from jpaged.pallas.reference import paged_attention_stacked, ragged_paged_attention_reference

TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Static step shapes and the random draw's ranges."""

    num_tokens: int
    num_seq_slots: int
    max_q_len: int
    max_context: int


PREFILL = Bucket(num_tokens=512, num_seq_slots=8, max_q_len=300, max_context=200)
DECODE = Bucket(num_tokens=64, num_seq_slots=32, max_q_len=12, max_context=300)


@dataclasses.dataclass(frozen=True)
class Config:
    kernel: str  # "gpu" | "tpu" | "cpu"
    dtype: str
    block_size: int
    num_kv_heads: int
    group: int
    head_dim: int
    bucket: Bucket
    sliding_window: int | None = None
    soft_cap: float | None = None

    @property
    def id(self) -> str:
        extras = (f"-window{self.sliding_window}" if self.sliding_window else "") + (
            f"-cap{self.soft_cap:g}" if self.soft_cap else ""
        )
        kind = "prefill" if self.bucket is PREFILL else "decode"
        return (
            f"{self.kernel}-{self.dtype}-B{self.block_size}-Hk{self.num_kv_heads}-G{self.group}-D{self.head_dim}"
            f"-{kind}{extras}"
        )


GPU_F32 = Config("gpu", "float32", 16, 2, 4, 32, PREFILL)
GPU_BF16 = Config("gpu", "bfloat16", 16, 2, 4, 32, PREFILL)
TPU_F32 = Config("tpu", "float32", 16, 2, 4, 32, PREFILL)
CPU_F32 = Config("cpu", "float32", 16, 3, 3, 64, PREFILL)  # SmolLM2's heads
CPU_BF16 = Config("cpu", "bfloat16", 16, 2, 4, 128, PREFILL)
CONFIGS = [
    CPU_F32,
    Config("cpu", "float32", 32, 2, 4, 24, DECODE, sliding_window=40),  # D=24: a partial 64-float chunk
    Config("cpu", "float32", 16, 1, 8, 32, PREFILL, soft_cap=2.0),
    Config("cpu", "float32", 16, 2, 2, 32, PREFILL, sliding_window=40),
    Config("cpu", "float32", 8, 2, 2, 16, DECODE),  # pages shorter than the kernel's eight-key groups
    Config("cpu", "float32", 32, 8, 1, 64, DECODE),  # 128 KB blocks: not streamed in whole first
    CPU_BF16,
    Config("cpu", "bfloat16", 32, 4, 1, 64, DECODE, sliding_window=40, soft_cap=2.0),
    Config("cpu", "bfloat16", 16, 2, 3, 40, DECODE),  # query heads in threes, D=40: a partial 32-float chunk
    # Decode rows on AVX-512-BF16 take the two-pass path: query heads in threes, twos and ones, D of 1-4 x 32 words
    Config("cpu", "bfloat16", 16, 3, 3, 64, DECODE),  # SmolLM2's heads
    Config("cpu", "bfloat16", 32, 2, 4, 128, DECODE),
    Config("cpu", "bfloat16", 16, 1, 2, 96, DECODE),
    Config("cpu", "bfloat16", 8, 2, 1, 32, DECODE),
    # Prefill tiles on AVX-512-BF16 take the sixteen-queries-a-register path: SmolLM2's heads (three registers a KV
    # head), one query head a KV head (one register, part-filled tiles), eight (passes of three, three and two)
    Config("cpu", "bfloat16", 16, 3, 3, 64, PREFILL),
    Config("cpu", "bfloat16", 8, 2, 1, 32, PREFILL),
    Config("cpu", "bfloat16", 32, 1, 8, 96, PREFILL),
    # Gemma's head size on both: Gemma 2 2B's heads (pairs) decoding, Gemma 3 1B's (four a KV head) in prefill
    Config("cpu", "bfloat16", 16, 2, 2, 256, DECODE),
    Config("cpu", "bfloat16", 16, 1, 4, 256, PREFILL),
    GPU_F32,
    Config("gpu", "float32", 32, 3, 3, 32, DECODE),
    Config("gpu", "float32", 16, 2, 1, 24, PREFILL, sliding_window=40),  # D=24: lanes padded to 32
    Config("gpu", "float32", 32, 1, 8, 32, PREFILL, soft_cap=2.0),
    GPU_BF16,
    Config("gpu", "bfloat16", 32, 2, 8, 64, DECODE, sliding_window=40, soft_cap=2.0),
    Config("gpu", "float16", 16, 2, 3, 32, DECODE),
    TPU_F32,
    pytest.param(
        Config("tpu", "bfloat16", 32, 2, 3, 256, DECODE, sliding_window=40, soft_cap=2.0),
        marks=pytest.mark.slow,
    ),
    pytest.param(Config("tpu", "float32", 16, 1, 8, 32, DECODE, sliding_window=40), marks=pytest.mark.slow),
    pytest.param(Config("tpu", "bfloat16", 16, 4, 1, 32, PREFILL, soft_cap=2.0), marks=pytest.mark.slow),
]


def draw_step(
    rng: np.random.Generator, cfg: Config, stale_value: float | None = None
) -> dict[str, np.ndarray]:
    """A random step: some decodes, some prefill chunks, random non-contiguous blocks, >= 1 padding slot.

    Cache slots no real sequence owns (the null block, unused blocks, the tails of partial last blocks) hold
    random values, or `stale_value` when given.
    """
    bucket = cfg.bucket
    num_real = int(rng.integers(1, bucket.num_seq_slots))
    q_lens, budget = [], bucket.num_tokens
    for s in range(num_real):
        q_len = 1 if rng.random() < 0.4 else int(rng.integers(1, bucket.max_q_len + 1))
        q_len = min(q_len, budget - (num_real - s - 1))
        q_lens.append(q_len)
        budget -= q_len
    kv_lens = np.zeros(bucket.num_seq_slots, np.int32)
    kv_lens[:num_real] = np.array(q_lens) + rng.integers(0, bucket.max_context + 1, num_real)
    return step_of_lengths(rng, cfg, q_lens, kv_lens, stale_value)


def step_of_lengths(
    rng: np.random.Generator,
    cfg: Config,
    q_lens: list[int],
    kv_lens: np.ndarray,
    stale_value: float | None = None,
    num_layers: int | None = None,
) -> dict[str, np.ndarray]:
    """A step of the real sequences' `q_lens` and `kv_lens` (padded to the bucket's slots) on random blocks and
    random values; with `num_layers`, the cache is stacked `[L, N, B, Hk, D]`, each layer drawn apart."""
    bucket, block_size, num_real = cfg.bucket, cfg.block_size, len(q_lens)
    kv_lens = np.pad(np.asarray(kv_lens, np.int32)[:num_real], (0, bucket.num_seq_slots - num_real))
    query_start = np.zeros(bucket.num_seq_slots + 1, np.int32)
    query_start[1 : num_real + 1] = np.cumsum(q_lens)
    query_start[num_real + 1 :] = query_start[num_real]  # padding sequences repeat the last offset

    table_width = math.ceil((bucket.max_q_len + bucket.max_context) / block_size) + 1
    num_blocks = 1 + bucket.num_seq_slots * table_width
    block_tables = np.zeros((bucket.num_seq_slots, table_width), np.int32)
    free_blocks = iter(rng.permutation(np.arange(1, num_blocks)))
    for s in range(num_real):
        for page in range(math.ceil(kv_lens[s] / block_size)):
            block_tables[s, page] = next(free_blocks)

    heads = cfg.num_kv_heads * cfg.group
    cache_shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    layers = () if num_layers is None else (num_layers,)
    k_pages, v_pages = (rng.standard_normal((*layers, *cache_shape)) for _ in "kv")
    if stale_value is not None:
        live = np.zeros(cache_shape[:2], bool)
        for s in range(num_real):
            positions = np.arange(kv_lens[s])
            live[block_tables[s, positions // block_size], positions % block_size] = True
        k_pages[..., ~live, :, :] = stale_value
        v_pages[..., ~live, :, :] = stale_value
    return dict(
        q=rng.standard_normal((bucket.num_tokens, heads, cfg.head_dim)),
        k_pages=k_pages,
        v_pages=v_pages,
        kv_lens=kv_lens,
        block_tables=block_tables,
        query_start=query_start,
        num_seqs=np.array([num_real], np.int32),
    )


def device_args(step: dict[str, np.ndarray], dtype: str) -> list[jax.Array]:
    float_names = ("q", "k_pages", "v_pages")
    return [
        jnp.asarray(value, dtype) if name in float_names else jnp.asarray(value)
        for name, value in step.items()
    ]


def sm_scale(cfg: Config) -> float:
    return 1.0 / math.sqrt(cfg.head_dim)


@functools.cache
def kernel_fn(cfg: Config, num_layers: int = 1):
    """The jitted kernel for `cfg` over a stacked cache of `num_layers` (the last one is read)."""
    options = dict(
        sm_scale=sm_scale(cfg),
        sliding_window=cfg.sliding_window,
        logits_soft_cap=cfg.soft_cap,
        interpret=True,
    )
    if cfg.kernel == "cpu":
        stacked = cpu.ragged_paged_attention_stacked
    elif cfg.kernel == "gpu":
        options.update(tiling=gpu.DECODE_TILING if cfg.bucket is DECODE else gpu.PREFILL_TILING)
        stacked = gpu.ragged_paged_attention_stacked
    else:
        options.update(
            tile_tokens=tpu.DECODE_TILE_TOKENS if cfg.bucket is DECODE else tpu.PREFILL_TILE_TOKENS
        )
        stacked = tpu.ragged_paged_attention_stacked

    def run(q, k_cache, v_cache, *metadata):
        return stacked(q, k_cache, v_cache, jnp.int32(num_layers - 1), *metadata, **options)

    return jax.jit(run)


def run_kernel(cfg: Config, args: list[jax.Array]) -> np.ndarray:
    q, k_pages, v_pages, *metadata = args
    return np.asarray(kernel_fn(cfg)(q, k_pages[None], v_pages[None], *metadata).astype(jnp.float32))


@functools.cache
def reference_fn(scale: float, sliding_window: int | None, soft_cap: float | None):
    return jax.jit(
        functools.partial(
            ragged_paged_attention_reference,
            sm_scale=scale,
            sliding_window=sliding_window,
            logits_soft_cap=soft_cap,
        )
    )


def oracle(cfg: Config, args: list[jax.Array]) -> np.ndarray:
    """Float64 attention of the inputs as the kernel saw them (after rounding to the kernel's dtype)."""
    host = [np.asarray(a.astype(jnp.float32)) if a.dtype != jnp.int32 else np.asarray(a) for a in args]
    return ragged_paged_attention_numpy(
        *host, sm_scale=sm_scale(cfg), sliding_window=cfg.sliding_window, logits_soft_cap=cfg.soft_cap
    )


def relative_error(out: np.ndarray, expected: np.ndarray, step: dict[str, np.ndarray]) -> float:
    """Max-norm error over the real query rows, relative to the largest expected value."""
    real_rows = int(step["query_start"][step["num_seqs"][0]])
    return float(np.abs(out[:real_rows] - expected[:real_rows]).max() / np.abs(expected[:real_rows]).max())


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.id)
def test_kernel_matches_float64_numpy_on_random_ragged_steps(cfg):
    rng = np.random.default_rng(zlib.crc32(cfg.id.encode()))
    for _ in range(1 if cfg.kernel == "tpu" else 3):  # the TPU simulator takes seconds per call
        step = draw_step(rng, cfg)
        args = device_args(step, cfg.dtype)
        out = run_kernel(cfg, args)
        assert np.isfinite(out).all(), "padding rows must be finite too"
        assert relative_error(out, oracle(cfg, args), step) < TOLERANCE[cfg.dtype]


@pytest.mark.parametrize("cfg", [GPU_F32, GPU_BF16, TPU_F32, CPU_F32, CPU_BF16], ids=lambda c: c.id)
def test_public_entry_point_matches_xla_reference(cfg):
    """Through `ragged_paged_attention` itself: 4-D pages, tiling chosen from the bucket's shapes."""
    module = {"gpu": gpu, "tpu": tpu, "cpu": cpu}[cfg.kernel]
    options = dict(sm_scale=sm_scale(cfg), sliding_window=cfg.sliding_window, logits_soft_cap=cfg.soft_cap)
    step = draw_step(np.random.default_rng(7), cfg)
    args = device_args(step, cfg.dtype)
    out = jax.jit(functools.partial(module.ragged_paged_attention, **options, interpret=True))(*args)
    reference = reference_fn(sm_scale(cfg), cfg.sliding_window, cfg.soft_cap)(*args)
    assert (
        relative_error(*(np.asarray(x.astype(jnp.float32)) for x in (out, reference)), step)
        < TOLERANCE[cfg.dtype]
    )


@pytest.mark.parametrize("impl", ["auto", "reference", "pallas", "cpu"])
def test_the_package_entry_point_dispatches_by_backend_and_impl(impl):
    """`from jpaged.pallas import ragged_paged_attention` is the one callable: on CPU `auto` and `cpu` take the C++
    kernel, `pallas` the GPU kernel in interpret mode, `reference` XLA; every one agrees with the oracle."""
    cfg = dataclasses.replace(CPU_F32, bucket=DECODE)
    step = draw_step(np.random.default_rng(11), cfg)
    args = device_args(step, cfg.dtype)
    call = functools.partial(ragged_paged_attention, sm_scale=sm_scale(cfg), impl=impl)
    out = np.asarray(jax.jit(call)(*args))
    assert relative_error(out, oracle(cfg, args), step) < TOLERANCE[cfg.dtype]


@pytest.mark.parametrize("cfg", [GPU_F32, TPU_F32, CPU_F32], ids=lambda c: c.id)
def test_stale_nan_in_unowned_cache_slots_never_reaches_the_output(cfg):
    """The null block, free blocks and the tails of partial blocks may hold anything; none of it is read."""
    step = draw_step(np.random.default_rng(3), cfg, stale_value=np.nan)
    args = device_args(step, cfg.dtype)
    out = run_kernel(cfg, args)
    assert np.isfinite(out).all()
    assert relative_error(out, oracle(cfg, args), step) < TOLERANCE[cfg.dtype]


@pytest.mark.parametrize("cfg", [GPU_F32, TPU_F32, CPU_F32], ids=lambda c: c.id)
def test_step_without_sequences_gives_finite_output(cfg):
    """What warm-up's dummy runs send: no live sequence at all."""
    step = draw_step(np.random.default_rng(4), cfg)
    step["num_seqs"][:] = 0
    assert np.isfinite(run_kernel(cfg, device_args(step, cfg.dtype))).all()


@pytest.mark.parametrize(
    "cfg", [GPU_F32, pytest.param(TPU_F32, marks=pytest.mark.slow), CPU_F32], ids=lambda c: c.id
)
def test_stacked_cache_attends_over_the_requested_layer_only(cfg):
    cfg = dataclasses.replace(cfg, bucket=DECODE)
    step = draw_step(np.random.default_rng(5), cfg)
    q, k_pages, v_pages, *metadata = device_args(step, cfg.dtype)
    decoy = jnp.full_like(k_pages, 100.0)  # layer 0: would dominate any softmax it leaked into
    out = kernel_fn(cfg, num_layers=2)(q, jnp.stack([decoy, k_pages]), jnp.stack([decoy, v_pages]), *metadata)
    assert relative_error(np.asarray(out), oracle(cfg, [q, k_pages, v_pages, *metadata]), step) < 1e-5


GPU_DECODES = [c for c in CONFIGS if getattr(c, "kernel", None) == "gpu" and c.bucket is DECODE]


@pytest.mark.parametrize("num_splits", [2, 4])
@pytest.mark.parametrize("cfg", GPU_DECODES, ids=lambda c: c.id)
def test_split_kv_decode_matches_float64_numpy(cfg, num_splits):
    """Each sequence's KV range split `num_splits` ways (some splits see no key at all) and combined."""
    rng = np.random.default_rng(zlib.crc32(f"{cfg.id}-{num_splits}".encode()))
    options = dict(sm_scale=sm_scale(cfg), sliding_window=cfg.sliding_window, logits_soft_cap=cfg.soft_cap)
    kernel = jax.jit(
        functools.partial(
            gpu.ragged_paged_attention,
            **options,
            interpret=True,
            tiling=gpu.DECODE_TILING,
            num_splits=num_splits,
        )
    )
    for stale in (None, np.nan):
        step = draw_step(rng, cfg, stale_value=stale)
        args = device_args(step, cfg.dtype)
        out = np.asarray(kernel(*args).astype(jnp.float32))
        assert np.isfinite(out).all()
        assert relative_error(out, oracle(cfg, args), step) < TOLERANCE[cfg.dtype]


# Gemma 2/3: sliding-window layers and global ones in one scan over the layers, the window per layer as data.
STACKED = {
    "reference": paged_attention_stacked,
    "cpu": cpu.ragged_paged_attention_stacked,
    "gpu": functools.partial(gpu.ragged_paged_attention_stacked, interpret=True),
    "tpu": functools.partial(tpu.ragged_paged_attention_stacked, interpret=True),
}
WINDOW = 20
LAYER_WINDOWS = (WINDOW, 0, WINDOW)  # 0: a global layer
# Two decodes, a prefill chunk after 30 cached keys and a first prompt chunk: prompts past the window, over blocks
GEMMA_BUCKET = Bucket(num_tokens=72, num_seq_slots=6, max_q_len=40, max_context=40)
GEMMA_Q_LENS, GEMMA_KV_LENS = [1, 1, 40, 23], [50, 9, 70, 23]


def window_of(window) -> int | None:
    """The oracle's window for an array window's value."""
    return int(window) if window > 0 else None


@pytest.mark.parametrize("soft_cap", [None, 2.0])
@pytest.mark.parametrize(("kernel", "dtype"), [(k, "float32") for k in STACKED] + [("cpu", "bfloat16")])
def test_one_scan_over_the_layers_gives_each_layer_its_own_window(kernel, dtype, soft_cap):
    """Gemma's head size (256) and a GQA pair, windows [W, 0, W] as an array the scan indexes: one program for
    local and global layers, each layer's output that of the oracle with its own window."""
    cfg = Config(kernel, dtype, 16, 2, 2, 256, GEMMA_BUCKET, soft_cap=soft_cap)
    rng = np.random.default_rng(zlib.crc32(cfg.id.encode()))
    step = step_of_lengths(rng, cfg, GEMMA_Q_LENS, GEMMA_KV_LENS, num_layers=len(LAYER_WINDOWS))
    q, k_cache, v_cache, *metadata = device_args(step, cfg.dtype)
    traces = []

    def attend(layer, window):
        traces.append(layer)
        options = dict(sm_scale=sm_scale(cfg), sliding_window=window, logits_soft_cap=soft_cap)
        return STACKED[kernel](q, k_cache, v_cache, layer, *metadata, **options)

    @jax.jit
    def all_layers(windows):
        layers = jnp.arange(windows.shape[0], dtype=jnp.int32)
        return lax.scan(lambda _, layer: (None, attend(layer, windows[layer])), None, layers)[1]

    out = np.asarray(all_layers(jnp.array(LAYER_WINDOWS, jnp.int32)).astype(jnp.float32))
    assert len(traces) == 1, "local and global layers must be one program"
    for layer, window in enumerate(LAYER_WINDOWS):
        expected = ragged_paged_attention_numpy(
            q,
            k_cache[layer],
            v_cache[layer],
            *metadata,
            sm_scale=sm_scale(cfg),
            sliding_window=window_of(window),
            logits_soft_cap=soft_cap,
        )
        assert relative_error(out[layer], expected, step) < TOLERANCE[cfg.dtype], f"layer {layer}"


@pytest.mark.parametrize("kernel", list(STACKED))
def test_a_function_jitted_once_serves_every_window_value_and_none_at_or_below_zero(kernel):
    """The window is an argument of the compiled program: W, 0 and -1 run what was traced once, and a window
    <= 0 attends as no window does."""
    cfg = Config(
        kernel, "float32", 16, 2, 2, 32, Bucket(num_tokens=48, num_seq_slots=4, max_q_len=30, max_context=30)
    )
    step = step_of_lengths(np.random.default_rng(13), cfg, [1, 30, 17], [45, 50, 17], num_layers=1)
    q, k_cache, v_cache, *metadata = device_args(step, cfg.dtype)
    traces = []

    @jax.jit
    def attend(window):
        traces.append(window)
        return STACKED[kernel](
            q, k_cache, v_cache, jnp.int32(0), *metadata, sm_scale=sm_scale(cfg), sliding_window=window
        )

    for window in (WINDOW, 0, -1):
        out = np.asarray(attend(jnp.int32(window)))
        expected = ragged_paged_attention_numpy(
            q, k_cache[0], v_cache[0], *metadata, sm_scale=sm_scale(cfg), sliding_window=window_of(window)
        )
        assert relative_error(out, expected, step) < TOLERANCE[cfg.dtype], f"window {window}"
    assert len(traces) == 1


# FP8 pages (`--kv-cache-dtype fp8`): stored = e4m3(k / k_scale), read as float(stored) * k_scale, a K and a V scale
# per layer, given as data (`k_scales[layer]` in the scan over the layers).
FP8_LAYER_SCALES = ((0.05, 3.0), (3.0, 0.05), (0.5, 1.0))  # (k_scale, v_scale) of each layer
FP8_CASES = [
    # kernel, q dtype, KV heads, group, head dim, windows per layer (None: no window argument at all)
    (kernel, "float32", 4, 2, 64, None)
    for kernel in STACKED
] + [(kernel, "bfloat16", 4, 2, 256, LAYER_WINDOWS) for kernel in STACKED]


def fp8_pages(values: np.ndarray, scales: np.ndarray) -> tuple[jax.Array, np.ndarray]:
    """Pages [L, ...] quantised with each layer's scale, and the float64 values they read as (float * scale)."""
    scales = np.asarray(scales, np.float64).reshape(-1, *[1] * (values.ndim - 1))
    pages = jnp.asarray(values / scales, jnp.float8_e4m3fn)
    return pages, np.asarray(pages.astype(jnp.float32), np.float64) * scales


@pytest.mark.parametrize(
    ("kernel", "dtype", "num_kv_heads", "group", "head_dim", "windows"),
    FP8_CASES,
    ids=[f"{c[0]}-{c[1]}-D{c[4]}{'-windows' if c[5] else ''}" for c in FP8_CASES],
)
def test_fp8_pages_read_as_their_values_times_each_layers_scales(
    kernel, dtype, num_kv_heads, group, head_dim, windows
):
    """Random K/V quantised to float8_e4m3fn with per-layer scales (0.05 to 3.0), read in one jitted scan over the
    layers with the scales (and windows) as data: each layer is the float64 oracle's on the dequantised pages."""
    cfg = Config(kernel, dtype, 16, num_kv_heads, group, head_dim, GEMMA_BUCKET)
    rng = np.random.default_rng(zlib.crc32(f"fp8-{cfg.id}".encode()))
    step = step_of_lengths(rng, cfg, GEMMA_Q_LENS, GEMMA_KV_LENS, num_layers=len(FP8_LAYER_SCALES))
    k_scales, v_scales = (np.array(s, np.float32) for s in zip(*FP8_LAYER_SCALES, strict=True))
    k_cache, k_values = fp8_pages(step["k_pages"] * k_scales[:, None, None, None, None], k_scales)
    v_cache, v_values = fp8_pages(step["v_pages"] * v_scales[:, None, None, None, None], v_scales)
    q, _, _, *metadata = device_args(step, cfg.dtype)
    traces = []

    @jax.jit
    def all_layers(k_scales, v_scales, windows):
        traces.append(1)

        def attend(_, layer):
            options = dict(
                sm_scale=sm_scale(cfg),
                sliding_window=None if windows is None else windows[layer],
                k_scale=k_scales[layer],
                v_scale=v_scales[layer],
            )
            return None, STACKED[kernel](q, k_cache, v_cache, layer, *metadata, **options)

        return lax.scan(attend, None, jnp.arange(len(FP8_LAYER_SCALES), dtype=jnp.int32))[1]

    layer_windows = None if windows is None else jnp.array(windows, jnp.int32)
    out = np.asarray(
        all_layers(jnp.asarray(k_scales), jnp.asarray(v_scales), layer_windows).astype(jnp.float32)
    )
    assert len(traces) == 1
    for layer in range(len(FP8_LAYER_SCALES)):
        expected = ragged_paged_attention_numpy(
            q.astype(jnp.float32),
            k_values[layer],
            v_values[layer],
            *metadata,
            sm_scale=sm_scale(cfg),
            sliding_window=None if windows is None else window_of(windows[layer]),
        )
        assert relative_error(out[layer], expected, step) < TOLERANCE[cfg.dtype], f"layer {layer}"


@pytest.mark.parametrize("impl", ["reference", "cpu", "pallas"])
def test_the_package_entry_point_reads_fp8_pages_with_python_float_scales(impl):
    cfg = dataclasses.replace(CPU_F32, num_kv_heads=4, group=2, bucket=DECODE)
    step = draw_step(np.random.default_rng(17), cfg)
    k_pages, k_values = fp8_pages(step["k_pages"][None] * 0.05, np.array([0.05]))
    v_pages, v_values = fp8_pages(step["v_pages"][None] * 3.0, np.array([3.0]))
    q, _, _, *metadata = device_args(step, cfg.dtype)
    call = functools.partial(
        ragged_paged_attention, sm_scale=sm_scale(cfg), k_scale=0.05, v_scale=3.0, impl=impl
    )
    out = np.asarray(jax.jit(call)(q, k_pages[0], v_pages[0], *metadata))
    expected = ragged_paged_attention_numpy(q, k_values[0], v_values[0], *metadata, sm_scale=sm_scale(cfg))
    assert relative_error(out, expected, step) < TOLERANCE[cfg.dtype]


@pytest.mark.parametrize(
    ("kernel", "dtype"), [(k, "float32") for k in STACKED] + [("cpu", "bfloat16"), ("reference", "bfloat16")]
)
def test_kv_scales_multiply_pages_of_any_dtype(kernel, dtype):
    """A scale with float32 or bfloat16 pages reads them scaled too (a model may always pass its layers' scales);
    bfloat16 on the C++ kernel: its AVX-512-BF16 paths, where the CPU has them (decode rows and prefill tiles)."""
    cfg = Config(
        kernel, dtype, 16, 4, 2, 32, Bucket(num_tokens=48, num_seq_slots=4, max_q_len=30, max_context=30)
    )
    step = step_of_lengths(np.random.default_rng(19), cfg, [1, 30, 17], [45, 50, 17], num_layers=1)
    q, k_cache, v_cache, *metadata = device_args(step, cfg.dtype)
    scales = dict(k_scale=jnp.float32(0.25), v_scale=jnp.array([2.0], jnp.float32))
    out = jax.jit(functools.partial(STACKED[kernel], sm_scale=sm_scale(cfg), **scales))(
        q, k_cache, v_cache, jnp.int32(0), *metadata
    )
    k_values, v_values = (np.asarray(x[0].astype(jnp.float32)) for x in (k_cache, v_cache))
    expected = ragged_paged_attention_numpy(
        q.astype(jnp.float32), k_values * 0.25, v_values * 2.0, *metadata, sm_scale=sm_scale(cfg)
    )
    assert relative_error(np.asarray(out.astype(jnp.float32)), expected, step) < TOLERANCE[cfg.dtype]


BAD_FP8_INPUTS = {
    "float16 q over fp8 pages": (dict(q_dtype=jnp.float16), "q dtype"),
    "k_scale of two elements": (dict(k_scale=jnp.ones((2,), jnp.float32)), "k_scale"),
    "int32 v_scale": (dict(v_scale=jnp.ones((1,), jnp.int32)), "v_scale"),
    "negative k_scale": (dict(k_scale=-1.0), "k_scale"),
    "a string v_scale": (dict(v_scale="1.0"), "v_scale"),
    "fp8 k_pages, float32 v_pages": (dict(v_dtype=jnp.float32), "v_pages dtype"),
}


@pytest.mark.parametrize("case", list(BAD_FP8_INPUTS))
@pytest.mark.parametrize("kernel", list(STACKED))
def test_bad_fp8_inputs_raise_value_error_naming_the_field(kernel, case):
    changes, field = BAD_FP8_INPUTS[case]
    changes = dict(changes)
    cfg = Config(kernel, "float32", 16, 4, 2, 32, DECODE)
    step = step_of_lengths(np.random.default_rng(23), cfg, [1], [5], num_layers=1)
    q, k_cache, v_cache, *metadata = device_args(step, cfg.dtype)
    q = q.astype(changes.pop("q_dtype", q.dtype))
    k_cache = k_cache.astype(jnp.float8_e4m3fn)
    v_cache = v_cache.astype(changes.pop("v_dtype", jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match=field):
        STACKED[kernel](q, k_cache, v_cache, jnp.int32(0), *metadata, sm_scale=0.1, **changes)


def test_the_tpu_kernels_e4m3_decoding_gives_every_finite_value():
    """On a TPU the kernel decodes fp8 pages from their bits with integer operations (the simulator reads them
    directly): every finite e4m3 value, subnormals and signed zeros included, comes out exact."""
    bits = np.arange(256, dtype=np.uint8)
    values = np.asarray(jnp.asarray(bits).view(jnp.float8_e4m3fn).astype(jnp.float32))
    decoded = np.asarray(jax.jit(tpu._e4m3_to_float32)(jnp.asarray(bits, jnp.int32)))
    finite = np.isfinite(values)
    assert finite.sum() == 254
    np.testing.assert_array_equal(decoded[finite], values[finite])
    np.testing.assert_array_equal(np.signbit(decoded[finite]), np.signbit(values[finite]))
