"""The warm-up stages after the first, compiled on a thread of their own while the engine serves (warmup_stages.py).

The thread only compiles: each finished stage waits in a queue until the engine's thread takes it (`take`), adds
its programs to the tables steps read and raises the step limits, so no table changes under a running step. Its
compiles use one core fewer than the machine has, leaving one to the steps being served.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from jpaged.runner.step_programs import CompiledSet, ProgramSet
from jpaged.runner.warmup_stages import WarmupStage

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LandedStage:
    stage: WarmupStage
    compiled: CompiledSet
    seconds: float


class BackgroundWarmup:
    """Compiles `stages` in order with `compile_set(programs, workers)`; the engine's thread takes them as they
    land."""

    def __init__(
        self,
        stages: list[tuple[WarmupStage, ProgramSet]],
        compile_set: Callable[[ProgramSet, int], CompiledSet],
    ) -> None:
        self.remaining = sum(len(programs) for _, programs in stages)  # programs not taken yet
        self._stages, self._compile_set = stages, compile_set
        self._landed: queue.SimpleQueue[LandedStage | None] = queue.SimpleQueue()  # None: it stopped short
        self._landing = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="jpaged-warmup", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        workers = max(1, (os.cpu_count() or 1) - 1)
        for stage, programs in self._stages:
            if self._stopping:
                break
            start = time.perf_counter()
            try:
                compiled = self._compile_set(programs, workers)
            except Exception:  # the engine serves on at the limits it has; nothing must die with the warm-up
                logger.exception(
                    "warm-up: compiling the steps of up to %d tokens failed", stage.max_num_batched_tokens
                )
                self._landed.put(None)
                break
            self._landed.put(LandedStage(stage, compiled, time.perf_counter() - start))
            self._landing.set()
        self._landing.set()

    def take(self) -> list[LandedStage]:
        """The stages compiled since the last call, in order (from the engine's thread)."""
        landed = []
        while not self._landed.empty():
            stage = self._landed.get()
            if stage is None:
                self.remaining = 0  # nothing more will land
                break
            self.remaining -= len(stage.compiled)
            landed.append(stage)
        return landed

    def wait(self, timeout: float) -> None:
        """Until a stage lands (or `timeout` seconds pass): for an engine whose waiting requests need it."""
        self._landing.wait(timeout)
        self._landing.clear()

    def stop(self) -> None:
        """Start no further stage (the one compiling finishes)."""
        self._stopping = True
