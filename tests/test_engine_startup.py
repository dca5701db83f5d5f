"""What an engine settles before its first step, with the accelerator faked: how many KV blocks its memory holds."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest

from jpaged.config import EngineConfig
from jpaged.core.kv_cache_sizing import GIB, kv_bytes_per_token
from jpaged.engine import startup
from jpaged.pallas.cpu import library as cpu_kernels
from jpaged.runner.tensor_parallel import tensor_parallel_mesh
from jpaged.runner.weight_layout import CPU_AUTO_DTYPE_ENV

PEAK = 64 << 20  # the step's activations, as activation_peak_bytes would measure them


@pytest.mark.parametrize(("platform", "share"), [("gpu", 1.0), ("tpu", 0.9)])
def test_the_memory_fraction_counts_once(monkeypatch, tiny_llama, platform, share):
    """On GPU the allocator's limit already is gpu_memory_utilization of the device (set before JAX started), so
    it is filled whole; a TPU's limit is the whole device, so the fraction applies to it."""
    limit = 10 * GIB  # a GPU's: 0.9 of its memory; a TPU's: all of it
    monkeypatch.setattr(startup, "device_memory", lambda: (platform, limit))
    monkeypatch.setattr(startup, "activation_peak_bytes", lambda *args: PEAK)
    config = EngineConfig(gpu_memory_utilization=0.9, max_model_len=128)
    size = startup.size_kv_cache(config, tiny_llama, max_model_len=128)
    mc = tiny_llama.config
    block_bytes = config.block_size * kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, 4)
    weights = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tiny_llama.params))
    assert size.num_blocks == (int(limit * share) - weights - PEAK) // block_bytes


def test_on_cpu_the_pool_is_sized_from_kv_cache_memory(tiny_llama):
    config = EngineConfig(kv_cache_memory=GIB // 4, max_model_len=128)
    mc = tiny_llama.config
    block_bytes = config.block_size * kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, 4)
    assert (
        startup.size_kv_cache(config, tiny_llama, max_model_len=128).num_blocks == (GIB // 4) // block_bytes
    )


def test_a_draft_models_pool_mirrors_the_targets_so_a_block_costs_both(monkeypatch, tiny_llama):
    """The target as its own draft: a block costs twice the bytes, and the weights are held twice."""
    monkeypatch.setattr(startup, "device_memory", lambda: ("gpu", 10 * GIB))
    monkeypatch.setattr(startup, "activation_peak_bytes", lambda *args: PEAK)
    config = EngineConfig(max_model_len=128)
    mc = tiny_llama.config
    block_bytes = config.block_size * kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, 4)
    weights = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tiny_llama.params))
    size = startup.size_kv_cache(config, tiny_llama, 128, draft=tiny_llama)
    assert size.num_blocks == (10 * GIB - 2 * weights - PEAK) // (2 * block_bytes)


@pytest.mark.parametrize(
    ("platform", "given", "expected"),
    [
        ("cpu", {}, (64, 512)),
        ("gpu", {}, (256, 8192)),
        ("tpu", {}, (256, 8192)),
        ("gpu", {"max_num_seqs": 32}, (32, 8192)),
        ("cpu", {"max_num_batched_tokens": 32}, (32, 32)),  # a step must hold one token of every sequence
        ("cpu", {"max_num_seqs": 1024}, (1024, 1024)),
    ],
)
def test_batch_sizes_left_open_take_the_platforms_defaults(platform, given, expected):
    config = EngineConfig(**given).for_platform(platform)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == expected


def test_an_engine_on_cpu_runs_with_the_cpu_defaults(tiny_llama):
    from jpaged.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(max_model_len=128, num_blocks=16, enforce_eager=True), model=tiny_llama)
    assert (engine.config.max_num_seqs, engine.config.max_num_batched_tokens) == (64, 512)


def test_with_tensor_parallelism_the_memory_is_per_device(tiny_llama):
    """Each of two devices holds half of every block (its KV heads): kv_cache_memory buys twice the blocks."""
    one, two = (
        startup.size_kv_cache(
            EngineConfig(kv_cache_memory=8 << 20, tensor_parallel_size=tp), tiny_llama, 128
        ).num_blocks
        for tp in (1, 2)
    )
    assert two == 2 * one
    # four devices, two KV heads: each device holds a copy of one, as with two
    four = startup.size_kv_cache(
        EngineConfig(kv_cache_memory=8 << 20, tensor_parallel_size=4), tiny_llama, 128
    )
    assert four.num_blocks == two
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size \(3\) must divide the model's 4 attention heads"
    ):
        startup.size_kv_cache(EngineConfig(tensor_parallel_size=3), tiny_llama, 128)
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size \(2\) exceeds the 1 devices this process has"
    ):
        tensor_parallel_mesh(2, tiny_llama.config)


@pytest.mark.parametrize(
    ("instructions", "expected"),
    [("avx512_bf16", "bfloat16"), (None, "float32")],
    ids=["bf16-dots", "no-dots"],
)
def test_auto_dtype_on_cpu_is_bfloat16_only_where_the_kernel_multiplies_bfloat16(
    monkeypatch, caplog, instructions, expected
):
    monkeypatch.delenv(CPU_AUTO_DTYPE_ENV)
    monkeypatch.setattr(cpu_kernels, "bfloat16_dot_products", lambda: instructions)
    with caplog.at_level(logging.INFO, logger="jpaged.runner.weight_layout"):
        _, dtype = startup.for_this_platform(EngineConfig(dtype="auto"))
    assert dtype == jnp.dtype(expected)
    assert f"dtype auto: {expected}" in caplog.text
    assert (instructions or "no bfloat16 dot-product instructions") in caplog.text


def test_an_explicit_dtype_is_kept_whatever_the_cpu(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "bfloat16_dot_products", lambda: "avx512_bf16")
    assert startup.for_this_platform(EngineConfig(dtype="float32"))[1] == jnp.float32


def test_the_environment_pins_what_auto_means_on_cpu(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "bfloat16_dot_products", lambda: None)
    monkeypatch.setenv(CPU_AUTO_DTYPE_ENV, "bfloat16")
    assert startup.for_this_platform(EngineConfig(dtype="auto"))[1] == jnp.bfloat16
    monkeypatch.setenv(CPU_AUTO_DTYPE_ENV, "float16")
    with pytest.raises(ValueError, match=CPU_AUTO_DTYPE_ENV):
        startup.for_this_platform(EngineConfig(dtype="auto"))
