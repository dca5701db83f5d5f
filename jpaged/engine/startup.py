"""What an engine settles before its first step: the model's dtype (after telling the accelerator's allocator how
much memory it may take) and how many KV blocks, device and host, fit."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.config import EngineConfig
from jpaged.core.kv_cache_sizing import (
    allocator_share,
    check_max_model_len_fits,
    configure_accelerator_allocator,
    determine_num_blocks,
    kv_bytes_per_token,
    startup_summary,
)
from jpaged.models.llama import params_dtype
from jpaged.models.loader import LoadedModel
from jpaged.pallas.cpu import attention as cpu_attention
from jpaged.pallas.cpu import library as cpu_kernels
from jpaged.runner.activation_peak import activation_peak_bytes
from jpaged.runner.tensor_parallel import check_tensor_parallel_size, tensor_parallel_config
from jpaged.runner.weight_layout import cpu_auto_dtype, held_weight_bytes

logger = logging.getLogger(__name__)


def for_this_platform(config: EngineConfig) -> tuple[EngineConfig, np.dtype]:
    """The config with this platform's default sizes where it leaves them open, and the dtype `config.dtype`
    means here (auto: bfloat16 on accelerators, on CPU as `cpu_auto_dtype` decides). Sets up the accelerator's
    allocator first: it must be configured before JAX initialises its backend; on CPU, starts the kernels' build."""
    configure_accelerator_allocator(config.gpu_memory_utilization)
    platform = jax.default_backend()
    if config.dtype != "auto":
        dtype = jnp.dtype(config.dtype)
    elif platform == "cpu":
        dtype = cpu_auto_dtype()
    else:
        dtype = jnp.dtype(jnp.bfloat16)
    if platform == "cpu" and dtype in cpu_kernels.SUPPORTED_DTYPES:
        # while the weights load (the products' kernels when the warm-up first traces them): a call waits for them
        attention = cpu_attention.kernel(dtype, fp8_pages=config.fp8_kv_cache)
        cpu_kernels.build_in_background(cpu_kernels.COMMON, attention)
    return config.for_platform(platform), dtype


@dataclass(frozen=True, slots=True)
class KVCacheSize:
    num_blocks: int  # device blocks, the null block 0 included
    num_swap_blocks: int  # host slots for swapped-out blocks
    max_model_len: int

    @property
    def runner_args(self) -> dict[str, int]:
        """What a ModelRunner of this pool takes."""
        return {"num_blocks": self.num_blocks, "max_model_len": self.max_model_len}


def size_kv_cache(
    config: EngineConfig, model: LoadedModel, max_model_len: int, draft: LoadedModel | None = None
) -> KVCacheSize:
    """Blocks for the pool (explicit num_blocks, else the device's memory on an accelerator less the weights and
    the step's activation peak, else kv_cache_memory on CPU) and for swap space; fails at start-up when one
    max_model_len sequence cannot fit. Memory is per device: with tensor parallelism each device holds its share
    of the weights and of every block (its KV heads). A draft model's pool mirrors the target's block for block:
    a block costs both models' bytes, and its weights are held beside the target's."""
    mc, params = model.config, model.params
    dtype_bytes = 1 if config.fp8_kv_cache else params_dtype(params).itemsize  # of a KV element
    tp = config.tensor_parallel_size
    check_tensor_parallel_size(tp, mc)
    bytes_per_token = kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype_bytes)
    device_bytes_per_token = kv_bytes_per_token(  # with more devices than KV heads, each holds a copy of one
        mc.num_layers, tensor_parallel_config(tp, mc).num_kv_heads // tp, mc.head_dim, dtype_bytes
    )
    held = held_weight_bytes(params, mc.hidden_activation, config.quantization)
    if draft is not None:
        dc = draft.config
        check_tensor_parallel_size(tp, dc)
        extra = kv_bytes_per_token(dc.num_layers, dc.num_kv_heads, dc.head_dim, dtype_bytes)
        bytes_per_token += extra
        device_bytes_per_token += kv_bytes_per_token(
            dc.num_layers, tensor_parallel_config(tp, dc).num_kv_heads // tp, dc.head_dim, dtype_bytes
        )
        for dtype, n in held_weight_bytes(draft.params, dc.hidden_activation, config.quantization).items():
            held[dtype] = held.get(dtype, 0) + n
    logger.info(
        "weights held: %s", ", ".join(f"{n / 2**20:.1f} MiB {dtype}" for dtype, n in sorted(held.items()))
    )
    platform, bytes_limit = device_memory()
    peak = 0
    if bytes_limit is not None and config.num_blocks is None:
        peak = activation_peak_bytes(config, mc, params, max_model_len)
    num_blocks = determine_num_blocks(
        block_size=config.block_size,
        bytes_per_token=device_bytes_per_token,
        num_blocks=config.num_blocks,
        kv_cache_memory=config.kv_cache_memory,
        device_memory=bytes_limit,
        gpu_memory_utilization=allocator_share(platform, config.gpu_memory_utilization),
        weight_bytes=sum(held.values()) // tp,
        activation_peak_bytes=peak,
    )
    check_max_model_len_fits(num_blocks, config.block_size, max_model_len)
    logger.info(startup_summary(num_blocks, config.block_size, bytes_per_token, max_model_len))
    num_swap_blocks = int(config.swap_space * 2**30 // (bytes_per_token * config.block_size))
    return KVCacheSize(num_blocks, num_swap_blocks, max_model_len)


def device_memory() -> tuple[str, int | None]:
    """The platform, and its allocator's byte limit on an accelerator (None on CPU, which sizes the pool from
    kv_cache_memory)."""
    platform = jax.default_backend()
    if platform == "cpu":
        return platform, None
    stats = jax.devices()[0].memory_stats() or {}
    return platform, stats.get("bytes_limit")
