"""How many KV blocks fit, and the start-up checks around it. Pure functions; no JAX import.

`num_blocks` always counts physical blocks including the null block 0, so a usable cache needs at least 2.
Under tensor parallelism pass the per-device `bytes_per_token` (kv heads are sharded) and per-device memory.
"""

from __future__ import annotations

import os

from jpaged.rounding import cdiv

GIB = 1 << 30
DEFAULT_CPU_KV_CACHE_MEMORY = 4 * GIB
MIN_NUM_BLOCKS = 2  # the null block plus one usable block


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes one token occupies in the cache across all layers, K and V."""
    for name, value in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("dtype_bytes", dtype_bytes),
    ):
        _require_positive_int(name, value)
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def determine_num_blocks(
    *,
    block_size: int,
    bytes_per_token: int,
    num_blocks: int | None = None,
    kv_cache_memory: int | None = None,
    device_memory: int | None = None,
    gpu_memory_utilization: float = 0.9,
    weight_bytes: int = 0,
    activation_peak_bytes: int = 0,
) -> int:
    """Physical blocks to preallocate: explicit `num_blocks` wins; with `device_memory` (an accelerator) the
    budget is device_memory * gpu_memory_utilization minus weights and the activation peak; otherwise (CPU)
    `kv_cache_memory` bytes, 4 GiB by default."""
    _require_positive_int("block_size", block_size)
    _require_positive_int("bytes_per_token", bytes_per_token)
    if num_blocks is not None:
        if not isinstance(num_blocks, int) or num_blocks < MIN_NUM_BLOCKS:
            raise ValueError(
                f"num_blocks must be an int >= {MIN_NUM_BLOCKS} (block 0 is reserved), got {num_blocks!r}"
            )
        return num_blocks
    bytes_per_block = block_size * bytes_per_token
    if device_memory is not None:
        _require_positive_int("device_memory", device_memory)
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        for name, value in (("weight_bytes", weight_bytes), ("activation_peak_bytes", activation_peak_bytes)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        budget = int(device_memory * gpu_memory_utilization) - weight_bytes - activation_peak_bytes
        field_name = "gpu_memory_utilization"
        detail = (
            f"{device_memory} bytes x {gpu_memory_utilization} - weights {weight_bytes}"
            f" - activation peak {activation_peak_bytes} = {budget} bytes"
        )
    else:
        budget = DEFAULT_CPU_KV_CACHE_MEMORY if kv_cache_memory is None else kv_cache_memory
        _require_positive_int("kv_cache_memory", budget)
        field_name = "kv_cache_memory"
        detail = f"{budget} bytes"
    result = max(budget, 0) // bytes_per_block
    if result < MIN_NUM_BLOCKS:
        raise ValueError(
            f"{field_name} leaves room for {result} KV blocks ({detail}; {bytes_per_block} bytes per block),"
            f" at least {MIN_NUM_BLOCKS} are needed: raise {field_name} or set num_blocks"
        )
    return result


def check_max_model_len_fits(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """Fail at start-up, naming the largest max_model_len that fits, if one sequence cannot fit."""
    _require_positive_int("max_model_len", max_model_len)
    capacity = (num_blocks - 1) * block_size
    if max_model_len > capacity:
        raise ValueError(
            f"max_model_len={max_model_len} does not fit in the KV cache ({num_blocks - 1} usable blocks x"
            f" {block_size} tokens = {capacity} tokens): the largest max_model_len that fits is {capacity};"
            f" lower max_model_len or give the KV cache more memory"
        )


def configure_accelerator_allocator(gpu_memory_utilization: float) -> dict[str, str]:
    """Stop JAX from grabbing 75% of GPU memory by itself; must run before JAX initialises its backend.

    Sets XLA_PYTHON_CLIENT_PREALLOCATE=false and XLA_PYTHON_CLIENT_MEM_FRACTION=gpu_memory_utilization unless
    the user already set them. Returns the values now in effect.
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{gpu_memory_utilization:.4g}")
    return {
        name: os.environ[name] for name in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION")
    }


def allocator_share(platform: str, gpu_memory_utilization: float) -> float:
    """The share of the allocator's byte limit the weights, activations and KV pool may fill. On GPU the limit
    already is gpu_memory_utilization of the device (configure_accelerator_allocator set the allocator's memory
    fraction before JAX started), so all of it: scaling it again would leave memory idle. On TPU the limit is the
    whole device, so the fraction applies here."""
    return 1.0 if platform == "gpu" else gpu_memory_utilization


def startup_summary(num_blocks: int, block_size: int, bytes_per_token: int, max_model_len: int) -> str:
    """The one start-up log line that says what the KV cache holds."""
    usable = num_blocks - 1
    blocks_per_seq = cdiv(max_model_len, block_size)
    total_gib = num_blocks * block_size * bytes_per_token / GIB
    return (
        f"KV cache: block_size={block_size}, num_blocks={num_blocks} ({usable} usable), "
        f"{bytes_per_token} KV bytes/token, {total_gib:.2f} GiB; "
        f"fits {usable // blocks_per_seq} sequences of max_model_len={max_model_len}"
    )


def _require_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
