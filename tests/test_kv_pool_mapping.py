"""The CPU kernel's KV pool is never zero-filled; warm-up maps in the blocks a full batch of max_model_len sequences
can hold (every layer's K and V, lowest blocks first), so no step of such a batch faults a page in, and leaves the
rest (prefix cache only) to be mapped in as written: a full warm-up before it returns, a progressive one in the
background while the engine has nothing to step. Mapping in writes nothing."""

from __future__ import annotations

import ctypes
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged import LLM
from jpaged.config import EngineConfig
from jpaged.engine.llm_engine import LLMEngine
from jpaged.pallas.cpu import attention as cpu_attention
from jpaged.pallas.cpu import huge_pages
from jpaged.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or jax.default_backend() != "cpu",
    reason="mapping memory in ahead is Linux's madvise, on the CPU backend's buffers",
)
PAGE = huge_pages.PAGE


def resident(start: int, length: int) -> np.ndarray:
    """Whether each whole page of [start, start + length) is mapped in (mincore)."""
    first, whole = huge_pages.aligned_span(start, length, PAGE)
    pages = (ctypes.c_ubyte * (whole // PAGE))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(first, whole, pages) == 0, ctypes.get_errno()
    return np.frombuffer(pages, np.uint8) & 1 == 1


def block_ranges(pool: jax.Array, first: int, end: int) -> list[tuple[int, int]]:
    """(address, bytes) of blocks [first, end) in every layer of a pool [L, N, B, Hk, D]."""
    layers, num_blocks = pool.shape[:2]
    layer_bytes = pool.nbytes // layers
    block_bytes = layer_bytes // num_blocks
    base = pool.unsafe_buffer_pointer()
    return [
        (base + layer * layer_bytes + first * block_bytes, (end - first) * block_bytes)
        for layer in range(layers)
    ]


def dropped(pool: jax.Array) -> jax.Array:
    """`pool` with the whole pages under it given back to the OS (MADV_DONTNEED): a fresh buffer may lie in memory
    an earlier one mapped in, and only what maps them in again should make them resident."""
    first, whole = huge_pages.aligned_span(pool.unsafe_buffer_pointer(), pool.nbytes, PAGE)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.madvise(first, whole, 4) == 0, ctypes.get_errno()  # MADV_DONTNEED
    return pool


def skip_unless_the_kernel_maps_in(pool: jax.Array) -> None:
    if not huge_pages.populate(pool.unsafe_buffer_pointer(), 2 * PAGE):
        pytest.skip("this kernel cannot map memory in ahead (MADV_POPULATE_WRITE came with Linux 5.14)")


def test_the_first_blocks_of_every_layer_are_mapped_in_and_the_rest_is_not():
    # 8 KiB blocks, 16 MiB layers
    pool = dropped(cpu_attention.uninitialized((3, 2048, 16, 2, 64), jnp.float32))
    mapped = cpu_attention.map_in_first_blocks(cpu_attention.pool_spans([pool]), 100)
    if mapped == 0:
        skip_unless_the_kernel_maps_in(pool)
    assert mapped == 3 * 100 * 8192
    for start, length in block_ranges(pool, 0, 100):
        assert resident(start, length).all()
    # 2 MiB clear of them: the OS may map in the huge pages around them whole
    for start, length in block_ranges(pool, 400, 1700):
        assert not resident(start, length).any()


def test_blocks_are_mapped_in_lowest_first_across_every_layer(monkeypatch):
    """What the first requests write (the lowest blocks of every layer) is mapped in before anything above it."""
    monkeypatch.setattr(cpu_attention, "MAP_CHUNK", 64 * 8192)  # 64 of these 8 KiB blocks at a time
    pool = cpu_attention.uninitialized((3, 256, 16, 2, 64), jnp.float32)
    calls = []
    monkeypatch.setattr(huge_pages, "populate", lambda start, length: calls.append((start, length)) or True)
    assert cpu_attention.map_in_first_blocks(cpu_attention.pool_spans([pool]), 200) == 3 * 200 * 8192
    firsts = [(start - pool.unsafe_buffer_pointer()) % (256 * 8192) // 8192 for start, _ in calls]
    assert firsts == [0, 0, 0, 64, 64, 64, 128, 128, 128, 192, 192, 192]
    assert [length // 8192 for _, length in calls] == [64] * 9 + [8] * 3


def test_mapping_in_keeps_what_the_memory_holds():
    values = np.random.default_rng(0).standard_normal((2, 64, 16, 2, 64)).astype(np.float32)
    pool = jnp.asarray(values)
    cpu_attention.map_in_first_blocks(cpu_attention.pool_spans([pool]), 64)
    np.testing.assert_array_equal(np.asarray(pool), values)
    # less than a page: nothing to do, not a failure
    assert huge_pages.populate(pool.unsafe_buffer_pointer(), 10)


def test_a_full_warm_up_maps_in_a_full_batch_worth_of_blocks_before_it_returns(tiny_model_dir, monkeypatch):
    asked = []
    map_in = cpu_attention.map_in_first_blocks
    monkeypatch.setattr(
        cpu_attention,
        "map_in_first_blocks",
        lambda pool, count, before_chunk: asked.append(count) or map_in(pool, count, before_chunk),
    )
    llm = LLM(str(tiny_model_dir("llama")), **SMALL)
    runner = llm.engine.runner
    assert runner.kv_pool_mapper.done.is_set()
    assert asked == [1 + 4 * runner.max_blocks_per_seq]  # the null block and 4 sequences of 64 tokens
    assert_mapped_in(runner, asked[0])


SMALL = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, num_blocks=4096)


def assert_mapped_in(runner, num_blocks: int) -> None:
    skip_unless_the_kernel_maps_in(runner.kv_cache.k)
    for pool in runner.kv_cache:
        for start, length in block_ranges(pool, 0, num_blocks):
            assert resident(start, length).all()


def test_a_progressive_warm_up_maps_in_only_while_the_engine_has_nothing_to_step(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), warmup="progressive", **SMALL))
    mapper = engine.runner.kv_pool_mapper
    assert mapper.paused and not mapper.done.is_set()  # nothing said idle yet: not one chunk mapped
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
        assert mapper.paused
    engine.warm_up_while_idle()  # what a server loop does with nothing to step
    assert not mapper.paused
    assert mapper.done.wait(timeout=600)  # in the background: a bound, not a race
    assert_mapped_in(engine.runner, 1 + 4 * engine.runner.max_blocks_per_seq)
