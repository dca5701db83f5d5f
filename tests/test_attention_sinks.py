"""Attention sinks (gpt-oss): a logit a query head that joins each row's softmax denominator and has no value,
p_j = exp(x_j - m) / (exp(s_h - m) + sum_i exp(x_i - m)), m = max(s_h, max_i x_i), as transformers'
GptOssAttention computes it. Every implementation the engine can pick against the float64 oracle
(numpy_attention.py) on fresh random steps, and the rule's limits: a -inf sink is none, a large one takes the
whole row's weight (output 0).

Shapes are small: the TPU kernel runs in its simulator and the GPU kernel in Pallas' interpreter.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from lowering import TRITON_CALL, export_text
from numpy_attention import ragged_paged_attention_numpy
from test_pallas_attention import (
    STACKED,
    TOLERANCE,
    Bucket,
    Config,
    device_args,
    relative_error,
    sm_scale,
    step_of_lengths,
)
from test_pallas_lowering import MOSAIC_TPU_CALL, step_shapes

from jpaged.pallas import gpu, ragged_paged_attention, tpu

# Two decodes, a prefill chunk after 36 cached keys, a first prompt chunk and a padding slot; 16-token pages.
BUCKET = Bucket(num_tokens=48, num_seq_slots=5, max_q_len=24, max_context=40)
Q_LENS, KV_LENS = [1, 1, 24, 13], [45, 9, 60, 13]
WINDOW = 20

KERNELS = list(STACKED)  # reference, cpu (C++), gpu and tpu (Pallas, interpreted)
# kernel, dtype, KV heads, group, head dim, window
CASES = [
    ("reference", "float32", 2, 4, 32, None),
    ("reference", "bfloat16", 2, 4, 32, WINDOW),
    ("cpu", "float32", 3, 3, 64, None),
    ("cpu", "float32", 2, 4, 32, WINDOW),
    # bfloat16 without a window or cap takes the AVX-512-BF16 paths where the CPU has them (query heads in
    # threes and twos for decode rows; prefill tiles sixteen queries a register); with a window, the float path.
    ("cpu", "bfloat16", 3, 3, 64, None),
    ("cpu", "bfloat16", 2, 4, 64, None),
    ("cpu", "bfloat16", 2, 4, 64, WINDOW),
    ("gpu", "float32", 2, 4, 32, None),
    ("gpu", "bfloat16", 2, 4, 32, WINDOW),
    ("tpu", "float32", 2, 4, 32, WINDOW),
    ("tpu", "bfloat16", 2, 4, 32, None),
]


def case_id(case) -> str:
    kernel, dtype, num_kv_heads, group, head_dim, window = case
    return f"{kernel}-{dtype}-Hk{num_kv_heads}-G{group}-D{head_dim}" + (f"-window{window}" if window else "")


def draw(case, seed_text: str = ""):
    """A random step of BUCKET for `case` (cache stacked, one layer), and random sinks of its scores' size."""
    kernel, dtype, num_kv_heads, group, head_dim, window = case
    cfg = Config(kernel, dtype, 16, num_kv_heads, group, head_dim, BUCKET, sliding_window=window)
    rng = np.random.default_rng(zlib.crc32(f"sinks-{case_id(case)}{seed_text}".encode()))
    step = step_of_lengths(rng, cfg, Q_LENS, KV_LENS, num_layers=1)
    sinks = rng.normal(1.0, 2.0, num_kv_heads * group).astype(np.float32)  # some rule their rows, some not
    return cfg, step, device_args(step, dtype), sinks


@functools.cache
def attend_fn(kernel: str, scale: float, window: int | None, **options):
    """The jitted stacked-cache kernel, sinks an argument (traced, as `sinks[layer]` in the model's scan is)."""

    def attend(q, k_cache, v_cache, metadata, sinks):
        layer = jnp.int32(0)
        return STACKED[kernel](
            q,
            k_cache,
            v_cache,
            layer,
            *metadata,
            sm_scale=scale,
            sliding_window=window,
            sinks=sinks,
            **options,
        )

    return jax.jit(attend)


def run(cfg: Config, args, sinks, **options) -> np.ndarray:
    q, k_cache, v_cache, *metadata = args
    attend = attend_fn(cfg.kernel, sm_scale(cfg), cfg.sliding_window, **options)
    sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32)
    return np.asarray(attend(q, k_cache, v_cache, metadata, sinks).astype(jnp.float32))


def oracle(cfg: Config, args, sinks) -> np.ndarray:
    """Float64 attention of the inputs as the kernel saw them (rounded to its dtype)."""
    q, k_cache, v_cache, *metadata = (
        np.asarray(a.astype(jnp.float32)) if a.dtype != jnp.int32 else a for a in args
    )
    return ragged_paged_attention_numpy(
        q,
        k_cache[0],
        v_cache[0],
        *metadata,
        sm_scale=sm_scale(cfg),
        sliding_window=cfg.sliding_window,
        sinks=sinks,
    )


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_sinks_match_float64_numpy_on_a_ragged_step(case):
    cfg, step, args, sinks = draw(case)
    out = run(cfg, args, sinks)
    assert np.isfinite(out).all()
    expected = oracle(cfg, args, sinks)
    assert relative_error(out, expected, step) < TOLERANCE[cfg.dtype]
    # the sinks change the output far past the tolerance: the check above is of them, not of plain attention
    assert relative_error(out, oracle(cfg, args, None), step) > 10 * TOLERANCE[cfg.dtype]


# Every kernel in float32, and the C++ kernel's AVX-512-BF16 paths
EACH_KERNEL = [(kernel, "float32", 2, 4, 32, None) for kernel in KERNELS] + [
    ("cpu", "bfloat16", 2, 4, 64, None)
]


@pytest.mark.parametrize("case", EACH_KERNEL, ids=case_id)
def test_a_minus_infinite_sink_is_no_sink(case):
    """-inf (or -1e30, the kernels' own "minus infinity") weighs nothing: the output is that without sinks."""
    cfg, step, args, _ = draw(case)
    heads = cfg.num_kv_heads * cfg.group
    without = run(cfg, args, None)
    for value in (-np.inf, -1e30):
        out = run(cfg, args, np.full(heads, value, np.float32))
        assert np.isfinite(out).all()
        assert relative_error(out, without, step) < 1e-6, value


@pytest.mark.parametrize("case", EACH_KERNEL, ids=case_id)
def test_a_larger_sink_shrinks_every_row_toward_zero(case):
    """Each row is the sinkless row times sum / (sum + exp(s - m)): a smaller norm as the sink grows, and nothing
    left once it dwarfs every score."""
    cfg, step, args, _ = draw(case)
    heads = cfg.num_kv_heads * cfg.group
    real_rows = int(step["query_start"][step["num_seqs"][0]])
    norms = [np.linalg.norm(run(cfg, args, None)[:real_rows], axis=-1)]
    for value in (2.0, 5.0, 40.0):
        norms.append(np.linalg.norm(run(cfg, args, np.full(heads, value, np.float32))[:real_rows], axis=-1))
    for smaller, larger in zip(norms[1:], norms[:-1], strict=True):
        assert (smaller < larger).all()
    assert norms[-1].max() < 1e-9 * norms[0].max()


@pytest.mark.parametrize("kernel", KERNELS)
def test_one_scan_over_the_layers_gives_each_layer_its_own_sinks(kernel):
    """The model's use: `sinks[layer]` indexed inside the scan over the layers, one program for them all."""
    cfg, step, _, _ = draw((kernel, "float32", 2, 4, 32, None))
    rng = np.random.default_rng(zlib.crc32(f"scan-{kernel}".encode()))
    num_layers, heads = 2, cfg.num_kv_heads * cfg.group
    step = step_of_lengths(rng, cfg, Q_LENS, KV_LENS, num_layers=num_layers)
    q, k_cache, v_cache, *metadata = device_args(step, cfg.dtype)
    layer_sinks = rng.normal(1.0, 2.0, (num_layers, heads)).astype(np.float32)

    @jax.jit
    def all_layers(sinks):
        def attend(_, layer):
            options = dict(sm_scale=sm_scale(cfg), sinks=sinks[layer])
            return None, STACKED[kernel](q, k_cache, v_cache, layer, *metadata, **options)

        return lax.scan(attend, None, jnp.arange(num_layers, dtype=jnp.int32))[1]

    out = np.asarray(all_layers(jnp.asarray(layer_sinks)))
    for layer in range(num_layers):
        expected = ragged_paged_attention_numpy(
            q, k_cache[layer], v_cache[layer], *metadata, sm_scale=sm_scale(cfg), sinks=layer_sinks[layer]
        )
        assert relative_error(out[layer], expected, step) < TOLERANCE[cfg.dtype], f"layer {layer}"


BAD_SINKS = {
    "one too few": (np.zeros(7, np.float32), r"sinks must be float32\[8\]"),
    "bfloat16": (jnp.zeros(8, jnp.bfloat16), r"sinks must be float32\[8\]"),
    "a list": ([0.0] * 8, "sinks must be None or a float32 array"),
}


@pytest.mark.parametrize("case", list(BAD_SINKS))
@pytest.mark.parametrize("kernel", KERNELS)
def test_bad_sinks_raise_value_error_naming_the_field(kernel, case):
    sinks, message = BAD_SINKS[case]
    cfg, _, args, _ = draw((kernel, "float32", 2, 4, 32, None))
    q, k_cache, v_cache, *metadata = args
    with pytest.raises(ValueError, match=message):
        STACKED[kernel](q, k_cache, v_cache, jnp.int32(0), *metadata, sm_scale=0.1, sinks=sinks)


# The Pallas kernels: the GPU one splitting the KV range, both lowered for their devices.


@pytest.mark.parametrize("num_splits", [2, 4])
def test_split_kv_decode_counts_each_sink_once(num_splits):
    """The GPU kernel's KV range split (16 keys a step: up to four steps a sequence, so every split sees keys): the
    sink joins the first split's part only, and the combine sees it once."""
    cfg, step, args, sinks = draw(("gpu", "float32", 2, 4, 32, None), f"-splits{num_splits}")
    tiling = gpu.GpuTiling(rows=16, kv_tokens=16)
    out = run(cfg, args, sinks, tiling=tiling, num_splits=num_splits)
    assert relative_error(out, oracle(cfg, args, sinks), step) < TOLERANCE[cfg.dtype]


GPT_OSS_HEADS = (64, 8, 64)  # query heads, KV heads, head dim of gpt-oss-20b and -120b


@pytest.mark.parametrize("bucket", ["decode-few", "prefill"])
@pytest.mark.parametrize(
    ("module", "platform", "call"),
    [(gpu, "cuda", TRITON_CALL), (tpu, "tpu", MOSAIC_TPU_CALL)],
    ids=["gpu", "tpu"],
)
def test_kernels_lower_with_each_layers_sinks_as_data(module, platform, call, bucket):
    """gpt-oss's heads, bfloat16: each layer's sinks (and window) indexed inside the scan, one kernel in the
    step (in decode-few, the GPU kernel splits the KV range)."""
    q, k_pages, _, *metadata = step_shapes(bucket, GPT_OSS_HEADS, jnp.bfloat16)
    num_layers = 2
    cache = jax.ShapeDtypeStruct((num_layers, *k_pages.shape), k_pages.dtype)
    windows = jax.ShapeDtypeStruct((num_layers,), jnp.int32)
    sinks = jax.ShapeDtypeStruct((num_layers, GPT_OSS_HEADS[0]), jnp.float32)
    attend = functools.partial(module.ragged_paged_attention_stacked, sm_scale=0.125)

    def all_layers(q, k_cache, v_cache, windows, sinks, *metadata):
        def layer(x, i):
            return attend(x, k_cache, v_cache, i, *metadata, sliding_window=windows[i], sinks=sinks[i]), None

        return lax.scan(layer, q, jnp.arange(num_layers, dtype=jnp.int32))[0]

    text = export_text(all_layers, platform, [q, cache, cache, windows, sinks, *metadata])
    assert text.count(f"custom_call @{call}(") == 1


# The dispatch: the package entry point and tensor parallelism.


@pytest.mark.parametrize("impl", ["auto", "reference", "pallas", "cpu"])
def test_the_package_entry_point_passes_sinks_to_every_impl(impl):
    cfg, step, args, sinks = draw(("reference", "float32", 2, 4, 32, None), "-entry")
    q, k_cache, v_cache, *metadata = args
    call = functools.partial(ragged_paged_attention, sm_scale=sm_scale(cfg), impl=impl)
    out = np.asarray(jax.jit(call)(q, k_cache[0], v_cache[0], *metadata, sinks=jnp.asarray(sinks)))
    assert relative_error(out, oracle(cfg, args, sinks), step) < TOLERANCE[cfg.dtype]


# Run in a process of its own: the simulated devices must be asked for before JAX starts.
TENSOR_PARALLEL_SCRIPT = """
    import jax, jax.numpy as jnp, numpy as np
    from jpaged.pallas.reference import paged_attention_stacked
    from jpaged.pallas.cpu.attention import ragged_paged_attention_stacked as cpu_stacked
    from jpaged.runner.tensor_parallel import AXIS, kv_sharding, shard_attention
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), (AXIS,))
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((6, 8, 32)), jnp.float32)  # Hq 8 over Hk 2
    k, v = (jnp.asarray(rng.standard_normal((1, 5, 16, 2, 32)), jnp.float32) for _ in "kv")
    metadata = (jnp.array([40, 3], jnp.int32), jnp.array([[1, 2, 3], [4, 0, 0]], jnp.int32),
                jnp.array([0, 5, 6], jnp.int32), jnp.array([2], jnp.int32))
    sinks = jnp.asarray(rng.normal(1.0, 2.0, 8), jnp.float32)
    k_split, v_split = (jax.device_put(x, kv_sharding(mesh)) for x in (k, v))
    q_split = jax.device_put(q, NamedSharding(mesh, P(None, AXIS, None)))
    for attention in (paged_attention_stacked, cpu_stacked):
        one = attention(q, k, v, jnp.int32(0), *metadata, sm_scale=0.2, sinks=sinks)
        split = jax.jit(lambda q, k, v, s: shard_attention(attention, mesh)(
            q, k, v, jnp.int32(0), *metadata, sm_scale=0.2, sinks=s))(q_split, k_split, v_split, sinks)
        assert float(jnp.abs(one - split).max()) < 1e-6, float(jnp.abs(one - split).max())
        plain = attention(q, k, v, jnp.int32(0), *metadata, sm_scale=0.2)
        assert float(jnp.abs(one - plain).max()) > 1e-2  # the sinks count
    print("ok")
"""


def test_tensor_parallel_attention_splits_the_sinks_by_heads_like_q():
    """Two devices, four query heads each: each device's kernel takes its own heads' sinks."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TENSOR_PARALLEL_SCRIPT)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=Path(__file__).parent.parent,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
