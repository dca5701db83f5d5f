"""On a Linux CPU the engine's weights and KV pool sit in memory asked for as transparent huge pages, and asking
changes nothing an array holds."""

from __future__ import annotations

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jpaged import LLM
from jpaged.pallas.cpu import huge_pages

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not Path("/sys/kernel/mm/transparent_hugepage").is_dir(),
    reason="transparent huge pages are a Linux feature this kernel lacks",
)


def vma_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    found, flags = False, set()
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            if found:
                break
            start, end = (int(part, 16) for part in head.split("-"))
            found = start <= address < end
        elif found and head == "VmFlags:":
            flags = set(line.split()[1:])
    assert found, f"no mapping holds {address:#x}"
    return flags


def huge_part(array) -> int:
    start, length = huge_pages.aligned_span(array.unsafe_buffer_pointer(), array.nbytes)
    assert length, "the array spans no whole huge page"
    return start


def test_asking_marks_the_memory_under_an_array_and_keeps_its_values():
    values = np.random.default_rng(0).standard_normal((4, 1 << 20), np.float32)  # 16 MiB
    array = jnp.asarray(values)
    asked = huge_pages.advise({"w": array})
    start, length = huge_pages.aligned_span(array.unsafe_buffer_pointer(), array.nbytes)
    assert asked == length >= 7 * huge_pages.HUGE_PAGE  # 8 huge pages of bytes, maybe unaligned
    assert "hg" in vma_flags(start)  # madvise(MADV_HUGEPAGE) took
    np.testing.assert_array_equal(np.asarray(array), values)


def test_the_engine_asks_for_huge_pages_under_its_weights_and_kv_pool(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), max_model_len=128, num_blocks=2048, enforce_eager=True)
    runner = llm.engine.runner
    pages = list(runner.kv_cache)
    big_weights = [w for w in huge_pages.cpu_buffers(runner.params) if w.nbytes >= 4 * huge_pages.HUGE_PAGE]
    assert pages and big_weights
    for array in pages + big_weights:
        assert "hg" in vma_flags(huge_part(array))
