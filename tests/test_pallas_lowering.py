"""Every kernel configuration the engine uses lowers for real GPUs and TPUs, checked on this CPU-only machine.

`jax.export` for `platforms=["cuda"]` / `["tpu"]` runs Pallas' Triton and Mosaic lowering here, which rejects bad
block shapes and unsupported operations before any device sees the code. It does not run what the device's
compiler does after that (Triton's PTX passes, Mosaic's layout passes in libtpu): those need the device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton
from lowering import TRITON_CALL, export_text

from jpaged.pallas import gpu, tpu

MOSAIC_TPU_CALL = "tpu_custom_call"  # stable, exportable without disabling any check

BLOCK_SIZE = 16
# (tokens T, sequence slots S); "decode-few" splits the KV range on GPU (pallas.split_kv.choose_num_splits)
BUCKETS = {"decode": (256, 256), "decode-few": (8, 8), "prefill": (2048, 8)}
MAX_MODEL_LEN = 4096
# (query heads, KV heads, head dim) of models the engine serves; TPU needs tileable KV head counts.
GEMMA2_2B = (8, 4, 256)
GPU_MODELS = {
    "smollm2-135m": (9, 3, 64),
    "llama3-8b": (32, 8, 128),
    "phi2": (32, 32, 80),
    "gemma2-2b": GEMMA2_2B,
}
TPU_MODELS = {"qwen2.5-0.5b": (14, 2, 64), "llama3-8b": (32, 8, 128), "gemma2-2b": GEMMA2_2B}


def step_shapes(bucket: str, heads: tuple[int, int, int], dtype) -> list[jax.ShapeDtypeStruct]:
    num_tokens, num_seq_slots = BUCKETS[bucket]
    num_q_heads, num_kv_heads, head_dim = heads
    table_width = MAX_MODEL_LEN // BLOCK_SIZE
    cache = jax.ShapeDtypeStruct((1 + num_seq_slots * table_width, BLOCK_SIZE, num_kv_heads, head_dim), dtype)
    return [
        jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), dtype),
        cache,
        cache,
        jax.ShapeDtypeStruct((num_seq_slots,), jnp.int32),
        jax.ShapeDtypeStruct((num_seq_slots, table_width), jnp.int32),
        jax.ShapeDtypeStruct((num_seq_slots + 1,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    ]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bucket", list(BUCKETS))
@pytest.mark.parametrize("model", list(GPU_MODELS))
def test_gpu_kernel_lowers_to_triton_for_cuda(model, bucket, dtype):
    fn = functools.partial(
        gpu.ragged_paged_attention, sm_scale=0.125, sliding_window=1024, logits_soft_cap=30.0
    )
    assert TRITON_CALL in export_text(fn, "cuda", step_shapes(bucket, GPU_MODELS[model], dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bucket", list(BUCKETS))
@pytest.mark.parametrize("model", list(TPU_MODELS))
def test_tpu_kernel_lowers_to_mosaic_for_tpu(model, bucket, dtype):
    fn = functools.partial(
        tpu.ragged_paged_attention, sm_scale=0.125, sliding_window=1024, logits_soft_cap=30.0
    )
    assert MOSAIC_TPU_CALL in export_text(fn, "tpu", step_shapes(bucket, TPU_MODELS[model], dtype))


@pytest.mark.parametrize(
    ("module", "platform", "call"),
    [(gpu, "cuda", TRITON_CALL), (tpu, "tpu", MOSAIC_TPU_CALL)],
    ids=["gpu", "tpu"],
)
def test_stacked_cache_kernels_lower_with_a_traced_layer_index(module, platform, call):
    q, k_pages, v_pages, *metadata = step_shapes("decode", (32, 8, 128), jnp.bfloat16)
    stacked_cache = jax.ShapeDtypeStruct((4, *k_pages.shape), k_pages.dtype)
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    fn = functools.partial(module.ragged_paged_attention_stacked, sm_scale=0.125)
    assert call in export_text(fn, platform, [q, stacked_cache, stacked_cache, layer, *metadata])


@pytest.mark.parametrize(
    ("module", "platform", "call"),
    [(gpu, "cuda", TRITON_CALL), (tpu, "tpu", MOSAIC_TPU_CALL)],
    ids=["gpu", "tpu"],
)
@pytest.mark.parametrize("bucket", ["decode", "prefill"])
def test_one_kernel_serves_every_layer_of_a_scan_with_windows_as_data(module, platform, call, bucket):
    """Gemma's layers: each one's window (<= 0: global) indexed from an array inside the scan over the layers, so
    the step holds one attention kernel, not one per kind of layer; head_dim 256."""
    q, k_pages, v_pages, *metadata = step_shapes(bucket, GEMMA2_2B, jnp.bfloat16)
    num_layers = 4
    stacked_cache = jax.ShapeDtypeStruct((num_layers, *k_pages.shape), k_pages.dtype)
    windows = jax.ShapeDtypeStruct((num_layers,), jnp.int32)
    attend = functools.partial(module.ragged_paged_attention_stacked, sm_scale=0.0625, logits_soft_cap=50.0)

    def all_layers(q, k_cache, v_cache, windows, *metadata):
        def layer(x, i):
            return attend(x, k_cache, v_cache, i, *metadata, sliding_window=windows[i]), None

        return lax.scan(layer, q, jnp.arange(num_layers, dtype=jnp.int32))[0]

    text = export_text(all_layers, platform, [q, stacked_cache, stacked_cache, windows, *metadata])
    assert text.count(f"custom_call @{call}(") == 1


def test_gpu_kernel_with_a_non_power_of_two_tile_is_rejected_at_lowering():
    fn = functools.partial(gpu.ragged_paged_attention_stacked, sm_scale=0.125, tiling=gpu.GpuTiling(24, 64))
    q, k_pages, v_pages, *metadata = step_shapes("prefill", (32, 8, 128), jnp.float32)
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    stacked_cache = jax.ShapeDtypeStruct((1, *k_pages.shape), k_pages.dtype)
    with pytest.raises(ValueError, match="power of 2"):
        export_text(fn, "cuda", [q, stacked_cache, stacked_cache, layer, *metadata])


def _doubling_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2


def _tiled_double(x: jax.Array, block: tuple[int, int], compiler_params) -> jax.Array:
    spec = pl.BlockSpec(block, lambda i: (i, 0))
    return pl.pallas_call(
        _doubling_kernel,
        grid=(x.shape[0] // block[0],),
        in_specs=[spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=compiler_params,
    )(x)


@pytest.mark.parametrize(
    ("platform", "compiler_params", "message"),
    [
        ("cuda", pltriton.CompilerParams(), "power of 2"),
        ("tpu", pltpu.CompilerParams(), "divisible by 8 and 128"),
    ],
)
def test_lowering_rejects_a_3x5_float32_block_so_these_checks_can_fail(platform, compiler_params, message):
    x = jax.ShapeDtypeStruct((12, 10), jnp.float32)
    good = functools.partial(_tiled_double, block=(12, 10), compiler_params=compiler_params)  # whole array
    bad = functools.partial(_tiled_double, block=(3, 5), compiler_params=compiler_params)
    if platform == "cuda":  # Triton wants power-of-two blocks even when they cover the array
        x = jax.ShapeDtypeStruct((16, 8), jnp.float32)
        good = functools.partial(_tiled_double, block=(16, 8), compiler_params=compiler_params)
    export_text(good, platform, [x])
    with pytest.raises(ValueError, match=message):
        export_text(bad, platform, [x])


@pytest.mark.parametrize(
    ("module", "platform", "call"),
    [(gpu, "cuda", TRITON_CALL), (tpu, "tpu", MOSAIC_TPU_CALL)],
    ids=["gpu", "tpu"],
)
@pytest.mark.parametrize(
    ("model", "bucket", "q_dtype"),
    [
        ("gemma2-2b", "decode", jnp.bfloat16),
        ("gemma2-2b", "prefill", jnp.bfloat16),
        ("llama3-8b", "decode", jnp.float32),
    ],
)
def test_kernels_lower_over_fp8_pages_with_each_layers_scales_as_data(
    module, platform, call, model, bucket, q_dtype
):
    """`--kv-cache-dtype fp8`: float8_e4m3fn pages under bfloat16 or float32 queries, each layer's K and V scales
    (and window) indexed from arrays inside the scan over the layers: one kernel in the step."""
    heads = {"gemma2-2b": GEMMA2_2B, "llama3-8b": (32, 8, 128)}[model]
    q, k_pages, _, *metadata = step_shapes(bucket, heads, q_dtype)
    num_layers = 3
    stacked_cache = jax.ShapeDtypeStruct((num_layers, *k_pages.shape), jnp.float8_e4m3fn)
    windows = jax.ShapeDtypeStruct((num_layers,), jnp.int32)
    scales = jax.ShapeDtypeStruct((num_layers,), jnp.float32)
    attend = functools.partial(module.ragged_paged_attention_stacked, sm_scale=0.0625, logits_soft_cap=50.0)

    def all_layers(q, k_cache, v_cache, windows, k_scales, v_scales, *metadata):
        def layer(x, i):
            options = dict(sliding_window=windows[i], k_scale=k_scales[i], v_scale=v_scales[i])
            return attend(x, k_cache, v_cache, i, *metadata, **options), None

        return lax.scan(layer, q, jnp.arange(num_layers, dtype=jnp.int32))[0]

    args = [q, stacked_cache, stacked_cache, windows, scales, scales, *metadata]
    assert export_text(all_layers, platform, args).count(f"custom_call @{call}(") == 1


# (K, N, group, code bits, codes dtype, scale dtype) of the matrices quantized checkpoints hold: Llama-3-8B's gate|up and down
# in W4A16 / W8A16 (group 128), Qwen3-8B's qkv in FP8 with 128 x 128 blocks, SmolLM2-135M's Q4_1 blocks (group 32).
GROUPED_MATRICES = {
    "llama3-8b-gate_up-w4a16": (4096, 28672, 128, 4, jnp.uint8, jnp.float16),
    "llama3-8b-down-w8a16": (14336, 4096, 128, 8, jnp.int8, jnp.float32),
    "qwen3-8b-qkv-fp8-blocks": (4096, 6144, 128, 8, jnp.float8_e4m3fn, jnp.float32),
    "smollm2-135m-q4_1": (576, 1536, 32, 4, jnp.uint8, jnp.float16),
}


@pytest.mark.parametrize("rows", [8, 256])
@pytest.mark.parametrize("matrix", list(GROUPED_MATRICES))
def test_the_gpu_grouped_kernel_lowers_to_triton_for_cuda(matrix, rows):
    from jpaged.pallas import gpu_grouped_matmul

    k, n, group, bits, codes, scales = GROUPED_MATRICES[matrix]
    args = [
        jax.ShapeDtypeStruct((rows, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((k * bits // 8, n), codes),
        *[jax.ShapeDtypeStruct((k // group, n), scales)] * 2,
    ]
    fn = functools.partial(gpu_grouped_matmul.matmul, bits=bits)
    assert export_text(fn, "cuda", args).count(f"custom_call @{TRITON_CALL}(") == 1
