"""Specifications of KV cache sizing: bytes per token, block counts, start-up checks, allocator setup."""

from __future__ import annotations

import pytest

from jpaged.core.kv_cache_sizing import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    GIB,
    check_max_model_len_fits,
    configure_accelerator_allocator,
    determine_num_blocks,
    kv_bytes_per_token,
    startup_summary,
)

SMOLLM2_135M_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # K and V, 30 layers, 3 kv heads, head_dim 64, float32


def test_kv_bytes_per_token_counts_k_and_v_over_all_layers():
    assert kv_bytes_per_token(30, 3, 64, 4) == SMOLLM2_135M_BYTES_PER_TOKEN == 46080


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "dtype_bytes"])
def test_kv_bytes_per_token_rejects_non_positive_fields(field):
    kwargs = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "dtype_bytes": 4, field: 0}
    with pytest.raises(ValueError, match=field):
        kv_bytes_per_token(**kwargs)


def test_explicit_num_blocks_wins_over_memory():
    assert (
        determine_num_blocks(block_size=16, bytes_per_token=1000, num_blocks=7, device_memory=80 * GIB) == 7
    )


def test_accelerator_budget_subtracts_weights_and_activation_peak():
    num_blocks = determine_num_blocks(
        block_size=16,
        bytes_per_token=1024,
        device_memory=100 * 1024 * 1024,
        gpu_memory_utilization=0.5,
        weight_bytes=10 * 1024 * 1024,
        activation_peak_bytes=8 * 1024 * 1024,
    )
    assert num_blocks == (50 - 10 - 8) * 1024 * 1024 // (16 * 1024)


def test_cpu_uses_kv_cache_memory_with_a_4_gib_default():
    assert determine_num_blocks(block_size=16, bytes_per_token=1024, kv_cache_memory=GIB) == GIB // (
        16 * 1024
    )
    assert DEFAULT_CPU_KV_CACHE_MEMORY == 4 * GIB
    assert determine_num_blocks(block_size=16, bytes_per_token=1024) == 4 * GIB // (16 * 1024)


def test_too_little_memory_names_the_field():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        determine_num_blocks(block_size=16, bytes_per_token=1024, device_memory=GIB, weight_bytes=GIB)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        determine_num_blocks(block_size=16, bytes_per_token=1024, kv_cache_memory=16 * 1024)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"bytes_per_token": -1}, "bytes_per_token"),
        ({"num_blocks": 1}, "num_blocks"),
        ({"kv_cache_memory": 0}, "kv_cache_memory"),
        ({"device_memory": GIB, "gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"device_memory": GIB, "weight_bytes": -1}, "weight_bytes"),
        ({"device_memory": GIB, "activation_peak_bytes": -1}, "activation_peak_bytes"),
    ],
)
def test_bad_sizing_arguments_name_the_field(kwargs, field):
    arguments = {"block_size": 16, "bytes_per_token": 1024, **kwargs}
    with pytest.raises(ValueError, match=field):
        determine_num_blocks(**arguments)


def test_max_model_len_that_fits_passes():
    check_max_model_len_fits(num_blocks=129, block_size=16, max_model_len=2048)


def test_max_model_len_too_long_names_the_largest_that_fits():
    with pytest.raises(ValueError, match="largest max_model_len that fits is 2032"):
        check_max_model_len_fits(num_blocks=128, block_size=16, max_model_len=2048)


def test_allocator_setup_disables_preallocation_and_caps_the_fraction(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    settings = configure_accelerator_allocator(0.85)
    assert settings == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.85"}


def test_allocator_setup_keeps_what_the_user_set(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    settings = configure_accelerator_allocator(0.9)
    assert settings == {"XLA_PYTHON_CLIENT_PREALLOCATE": "true", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}


def test_allocator_setup_rejects_bad_utilization():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        configure_accelerator_allocator(0.0)


def test_startup_summary_says_how_many_full_length_sequences_fit():
    line = startup_summary(num_blocks=1025, block_size=16, bytes_per_token=46080, max_model_len=2048)
    assert "block_size=16" in line
    assert "num_blocks=1025" in line
    assert "46080 KV bytes/token" in line
    assert "fits 8 sequences of max_model_len=2048" in line
