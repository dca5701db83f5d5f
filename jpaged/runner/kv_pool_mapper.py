"""Mapping in a CPU KV pool's first blocks before requests write them, at a time when it is in nobody's way.

The C++ kernel's pool is never zero-filled, so each page is mapped in when a step first writes it (~10% of a fresh
engine's first batches, scripts/KERNELS.md). Mapping the blocks a full batch can hold ahead of time takes that out
of the steps, but the mapping itself costs a core for seconds, and whatever runs beside it pays: on 2 cores a
decode step took 1.7x as long while it ran, and loading compiled programs from the cache up to 10x (both contend
for the process's memory map). So it runs where nothing waits on it: a full warm-up maps before it returns (the
memory is committed before the first request, as vLLM's zero-filled pool is); a progressive one maps on a thread of
its own, one chunk at a time, only while the engine has no request to step.
"""

from __future__ import annotations

import logging
import threading
import time

from jpaged.pallas.cpu import attention as cpu_attention

logger = logging.getLogger(__name__)


class KVPoolMapper:
    """Maps blocks [0, `count`) of every layer of `spans` (read off the pool's arrays when it was allocated: a
    step may donate them before the mapping runs)."""

    def __init__(self, spans: list[cpu_attention.PoolSpan], count: int) -> None:
        self._spans, self._count = spans, count
        self.done = threading.Event()  # set once the mapping is over
        self._idle = threading.Event()  # the background mapping goes on only while set

    def map_now(self) -> None:
        """Map everything on this thread."""
        self._idle.set()
        self._map("at start-up")

    def map_while_idle(self) -> None:
        """Map on a thread of its own, only while the engine says it is idle (`engine_idle`)."""
        threading.Thread(target=self._map, args=("while idle",), name="kv-pool-map", daemon=True).start()

    def engine_idle(self, idle: bool) -> None:
        """Whether the engine has nothing to step: the background mapping pauses after its chunk when not."""
        if idle:
            self._idle.set()
        else:
            self._idle.clear()

    @property
    def paused(self) -> bool:
        return not self._idle.is_set()

    def _map(self, when: str) -> None:
        start = time.perf_counter()
        try:
            mapped = cpu_attention.map_in_first_blocks(self._spans, self._count, before_chunk=self._idle.wait)
            seconds = time.perf_counter() - start
            logger.info("KV pool: %.0f MiB mapped in %s, %.1f s", mapped / 2**20, when, seconds)
        finally:
            self.done.set()
