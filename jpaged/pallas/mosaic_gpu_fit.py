"""What the Mosaic GPU attention kernel (mosaic_gpu.py) takes, without importing it: which GPUs run its products,
which cache layouts its tiles and shared memory fit, how deep its KV pipeline goes. The dispatcher
(`jpaged.pallas.gpu_kernel_for`) asks here."""

from __future__ import annotations

import jax.numpy as jnp

from jpaged.pallas.common import FP8_PAGES

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Query rows (tokens x GQA heads) of one tile, each product's M: Hopper's wgmma (sm_90a), Blackwell's tcgen05 into
# tensor memory (sm_100a, whose layout wants 128 rows).
TILE_ROWS = {"hopper": 64, "blackwell": 128}
KV_TOKENS = 64  # keys a step attends to (at least one page)
MAX_STAGES = 4  # shared-memory slots of the KV pipeline, where they fit
# Of the 227 KiB of shared memory a block may take on Hopper and Blackwell: room for Mosaic's own scratch.
SMEM_BUDGET = 216 * 1024


def arch_for(compute_capability: str | None) -> str | None:
    """The kernel's products for a GPU: Hopper's wgmma on 9.x, tcgen05 on datacenter Blackwell (10.x); None where
    neither runs (before Hopper, and consumer Blackwell's 12.x, which has no tcgen05)."""
    major = int(float(compute_capability)) if compute_capability else 0
    return {9: "hopper", 10: "blackwell"}.get(major)


def shared_memory_bytes(
    kv_tokens: int, head_dim: int, itemsize: int, page_itemsize: int, stages: int, rows: int
) -> int:
    """The query tile, p, `stages` slots of K and V pages, and (FP8 pages) one slot of each widened."""
    widened = 2 * kv_tokens * head_dim * itemsize if page_itemsize != itemsize else 0
    pages = 2 * stages * kv_tokens * head_dim * page_itemsize
    return (rows * head_dim + rows * kv_tokens) * itemsize + pages + widened


def pipeline_stages(kv_tokens: int, head_dim: int, itemsize: int, page_itemsize: int, rows: int) -> int:
    """The KV pipeline's depth: the most slots (2 to MAX_STAGES) that fit in shared memory; deeper pipelines keep
    more copies in flight, which is what decode's bandwidth needs."""
    fits = [
        n
        for n in range(2, MAX_STAGES + 1)
        if shared_memory_bytes(kv_tokens, head_dim, itemsize, page_itemsize, n, rows) <= SMEM_BUDGET
    ]
    return max(fits, default=2)


def check_layout(
    num_q_heads: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype,
    kv_dtype=None,
    arch: str = "hopper",
) -> None:
    """Raises ValueError naming the condition a cache layout misses for this kernel's tiles: `dtype` is the
    queries' (and the model's), `kv_dtype` the pages' (default `dtype`; float8_e4m3fn pages are widened)."""
    dtype, kv_dtype = jnp.dtype(dtype), jnp.dtype(kv_dtype or dtype)
    if dtype not in DTYPES:
        raise ValueError(f"the Mosaic GPU kernel takes bfloat16 or float16 queries and pages, not {dtype}")
    if kv_dtype not in (dtype, FP8_PAGES):
        raise ValueError(
            f"the Mosaic GPU kernel reads pages of the queries' dtype or float8_e4m3fn, not {kv_dtype}"
        )
    if head_dim % 64:
        raise ValueError(f"the Mosaic GPU kernel needs a head dim that is a multiple of 64, not {head_dim}")
    rows = TILE_ROWS[arch]
    if num_q_heads // num_kv_heads > rows:
        raise ValueError(f"the Mosaic GPU kernel packs at most {rows} query heads a KV head")
    if block_size not in (8, 16, 32, 64, 128):
        raise ValueError(
            f"the Mosaic GPU kernel needs pages of 8-128 tokens (a power of two), not {block_size}"
        )
    kv_tokens = max(KV_TOKENS, block_size)
    if shared_memory_bytes(kv_tokens, head_dim, dtype.itemsize, kv_dtype.itemsize, 2, rows) > SMEM_BUDGET:
        raise ValueError(
            f"the Mosaic GPU kernel's two-stage pipeline of {block_size}-token pages with head dim {head_dim} needs "
            f"more than {SMEM_BUDGET // 1024} KiB of shared memory"
        )
