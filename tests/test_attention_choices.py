"""How an attention kernel is chosen and set up: the GPU kernel's KV splits and tiles by bucket, `auto` by backend,
head size and dtype (the C++ CPU kernel falling back to the XLA reference where it cannot vectorise or be built),
and every kernel's ValueError naming the bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.pallas import gpu, resolve_attention_impl, split_kv, tpu
from jpaged.pallas.cpu import attention as cpu
from jpaged.pallas.reference import ragged_paged_attention_reference


def test_small_decode_buckets_split_the_kv_range_and_large_or_prefill_ones_do_not():
    # SmolLM2 (3 KV heads) at one sequence and a 4k context: 3 programs without splitting.
    assert split_kv.choose_num_splits(num_tokens=1, num_seq_slots=1, num_kv_heads=3, max_kv_len=4096) == 8
    assert split_kv.choose_num_splits(num_tokens=8, num_seq_slots=8, num_kv_heads=8, max_kv_len=4096) == 4
    assert split_kv.choose_num_splits(num_tokens=256, num_seq_slots=256, num_kv_heads=8, max_kv_len=4096) == 1
    assert (
        split_kv.choose_num_splits(num_tokens=1, num_seq_slots=1, num_kv_heads=8, max_kv_len=512) == 1
    )  # short
    assert split_kv.choose_num_splits(num_tokens=2048, num_seq_slots=8, num_kv_heads=3, max_kv_len=4096) == 1


def test_decode_heavy_buckets_take_short_tiles_and_prefill_buckets_tall_ones():
    assert gpu.choose_tiling(num_tokens=256, num_seq_slots=256, group=4) == gpu.DECODE_TILING
    assert gpu.choose_tiling(num_tokens=16, num_seq_slots=8, group=4) == gpu.DECODE_TILING
    assert gpu.choose_tiling(num_tokens=2048, num_seq_slots=8, group=4) == gpu.PREFILL_TILING
    # A tile must hold at least one token's whole GQA group.
    assert gpu.choose_tiling(num_tokens=16, num_seq_slots=8, group=32).rows == 32


def _valid_inputs() -> dict[str, jax.Array]:
    return dict(
        q=jnp.zeros((16, 8, 32)),
        k_pages=jnp.zeros((9, 16, 2, 32)),
        v_pages=jnp.zeros((9, 16, 2, 32)),
        kv_lens=jnp.zeros(8, jnp.int32),
        block_tables=jnp.zeros((8, 4), jnp.int32),
        query_start=jnp.zeros(9, jnp.int32),
        num_seqs=jnp.zeros(1, jnp.int32),
    )


@pytest.mark.parametrize("module", [gpu, tpu, cpu], ids=["gpu", "tpu", "cpu"])
@pytest.mark.parametrize(
    ("field", "bad_value", "options"),
    [
        ("q", jnp.zeros((16, 8)), {}),
        ("q", jnp.zeros((16, 8, 32), jnp.int8), {}),
        ("k_pages", jnp.zeros((9, 16, 3, 32)), {}),  # 8 query heads are not a multiple of 3 KV heads
        ("v_pages", jnp.zeros((9, 16, 2, 16)), {}),
        ("kv_lens", jnp.zeros(8, jnp.float32), {}),
        ("block_tables", jnp.zeros((7, 4), jnp.int32), {}),
        ("query_start", jnp.zeros(8, jnp.int32), {}),
        ("num_seqs", jnp.zeros(2, jnp.int32), {}),
        ("sliding_window", None, {"sliding_window": 0}),
        ("logits_soft_cap", None, {"logits_soft_cap": -1.0}),
    ],
)
def test_bad_input_raises_value_error_naming_the_field(module, field, bad_value, options):
    inputs = _valid_inputs()
    if bad_value is not None:
        inputs[field] = bad_value
    with pytest.raises(ValueError, match=field):
        module.ragged_paged_attention(*inputs.values(), sm_scale=1.0, interpret=True, **options)


@pytest.mark.parametrize(
    "attention",
    [
        gpu.ragged_paged_attention,
        tpu.ragged_paged_attention,
        cpu.ragged_paged_attention,
        ragged_paged_attention_reference,
    ],
    ids=["gpu", "tpu", "cpu", "reference"],
)
@pytest.mark.parametrize(
    "window",
    [0, -3, np.int64(0), 2.5, jnp.float32(4), jnp.array([4, 4], jnp.int32)],
    ids=["0", "-3", "numpy-0", "float", "f32", "int32x2"],
)
def test_a_window_is_a_positive_int_or_an_int32_scalar_array(attention, window):
    """A Python or numpy int is checked at trace time; an array's value is data (<= 0: none), so only its type is
    checked."""
    with pytest.raises(ValueError, match="sliding_window"):
        attention(*_valid_inputs().values(), sm_scale=1.0, interpret=True, sliding_window=window)


@pytest.mark.parametrize(
    ("num_kv_heads", "dtype"), [(3, jnp.float32), (1, jnp.bfloat16), (6, jnp.bfloat16), (12, jnp.float32)]
)
def test_tpu_kernel_rejects_kv_head_counts_vmem_cannot_tile(num_kv_heads, dtype):
    inputs = _valid_inputs()
    inputs["q"] = jnp.zeros((16, num_kv_heads, 32), dtype)
    inputs["k_pages"] = inputs["v_pages"] = jnp.zeros((9, 16, num_kv_heads, 32), dtype)
    with pytest.raises(ValueError, match="k_pages heads"):
        tpu.ragged_paged_attention(*inputs.values(), sm_scale=1.0)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "message"),
    [(jnp.float16, 32, "takes float32, bfloat16"), (jnp.float32, 20, "multiple of 8")],
)
def test_cpu_kernel_rejects_layouts_it_cannot_vectorise_and_auto_falls_back_to_the_reference(
    dtype, head_dim, message
):
    inputs = _valid_inputs()
    inputs["q"] = jnp.zeros((16, 8, head_dim), dtype)
    inputs["k_pages"] = inputs["v_pages"] = jnp.zeros((9, 16, 2, head_dim), dtype)
    with pytest.raises(ValueError, match=message):
        cpu.ragged_paged_attention(*inputs.values(), sm_scale=1.0)
    assert resolve_attention_impl("auto", head_dim=head_dim, dtype=dtype, backend="cpu") == "reference"
    with pytest.raises(ValueError, match=message):
        resolve_attention_impl("cpu", head_dim=head_dim, dtype=dtype, backend="cpu")


def test_an_fp8_pool_takes_the_cpu_kernel_on_cpu_and_tpu_needs_four_kv_heads_a_tile_for_it():
    fp8 = jnp.float8_e4m3fn
    assert resolve_attention_impl("auto", head_dim=64, dtype=fp8, backend="cpu") == "cpu"
    tpu.check_tpu_layout(4, 16, 128, fp8)
    with pytest.raises(ValueError, match="k_pages heads"):
        tpu.check_tpu_layout(2, 16, 128, fp8)


def test_auto_takes_the_cpu_kernel_on_cpu_and_pallas_elsewhere():
    assert resolve_attention_impl("auto", head_dim=64, dtype=jnp.float32, backend="cpu") == "cpu"
    assert resolve_attention_impl("auto", head_dim=64, dtype=jnp.bfloat16, backend="gpu") == "pallas"
    with pytest.raises(ValueError, match="CPU backend only"):
        resolve_attention_impl("cpu", head_dim=64, dtype=jnp.float32, backend="gpu")


@pytest.mark.parametrize("compiler", ["/bin/false", "no-such-compiler"], ids=["failing", "missing"])
def test_without_a_working_compiler_the_cpu_kernels_fall_back_to_xla_with_a_warning(compiler, tmp_path):
    """A fresh process (the kernel is built and registered once per process), an empty kernel cache."""
    program = (
        "import jax.numpy as jnp\n"
        "from jpaged.pallas import resolve_attention_impl\nfrom jpaged.pallas.cpu import matmul as cpu_matmul\n"
        "print(resolve_attention_impl('auto', head_dim=64, dtype=jnp.float32, backend='cpu'))\n"
        "print(cpu_matmul.supports(jnp.float32))\n"
    )
    env = {**os.environ, "CXX": compiler, "JPAGED_KERNEL_CACHE": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["reference", "False"]  # and the model's matrices take XLA's dots
    assert "could not be built" in result.stderr and "takes the XLA reference" in result.stderr
    assert not list(tmp_path.glob("*.so"))
