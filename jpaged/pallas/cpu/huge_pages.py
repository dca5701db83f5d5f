"""Transparent huge pages under the CPU backend's large arrays: the KV pool, whose pages attention reads scattered,
and the weights a decode step reads whole. In 4 KiB pages those reads miss the TLB far more often than in 2 MiB
ones (scripts/KERNELS.md has the A/B). XLA's allocator has no option for it, so this asks Linux (madvise) for the
memory under each buffer: the 2 MiB-aligned part of it, as what lies around may belong to another array.

Memory nothing has written yet (the pool, jpaged/pallas/cpu/attention.py) is then mapped in huge pages as it is
first written: at no cost. Memory already written (the weights) is moved into them by the kernel's khugepaged in
the background, over minutes; moving it at once (MADV_COLLAPSE) costs seconds of every start and weight update
for a gain too small to measure (scripts/KERNELS.md). Where the OS has no huge pages, the arrays stay as they are.
`populate` maps memory in before it is first written, for what must not pay that on a request's path.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterable

import jax

HUGE_PAGE = 1 << 21
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14
PAGE = 4096  # madvise's unit: its start must be a multiple


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise


_MADVISE = _madvise()


def cpu_buffers(arrays) -> Iterable[jax.Array]:
    """Every buffer of the CPU arrays in the pytree `arrays` (each shard of a sharded one)."""
    for leaf in jax.tree_util.tree_leaves(arrays):
        for shard in leaf.addressable_shards:
            if shard.device.platform == "cpu":
                yield shard.data


def aligned_span(pointer: int, nbytes: int, page: int = HUGE_PAGE) -> tuple[int, int]:
    """The whole pages of `page` bytes inside [pointer, pointer + nbytes): (start, length), length 0 where there
    are none."""
    start = -(-pointer // page) * page
    end = (pointer + nbytes) // page * page
    return start, max(0, end - start)


def advise(arrays) -> int:
    """Ask for huge pages under the CPU arrays of the pytree `arrays`; returns how many bytes the OS took the
    request for."""
    if _MADVISE is None:
        return 0
    done = 0
    for buffer in cpu_buffers(arrays):
        start, length = aligned_span(buffer.unsafe_buffer_pointer(), buffer.nbytes)
        if length and _MADVISE(start, length, _MADV_HUGEPAGE) == 0:
            done += length
    return done


def populate(start: int, length: int) -> bool:
    """Map in the whole pages inside [start, start + length) as a write would, without writing them
    (MADV_POPULATE_WRITE); False where the OS cannot (not Linux, a kernel before 5.14)."""
    first, whole = aligned_span(start, length, PAGE)
    return _MADVISE is not None and (not whole or _MADVISE(first, whole, _MADV_POPULATE_WRITE) == 0)
