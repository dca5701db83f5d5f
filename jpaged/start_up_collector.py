"""Python's cyclic garbage collector paused while a process starts (the `jpaged` command pauses it first thing).

A start-up creates millions of objects that live as long as the process (the modules of jax, flax, transformers and
fastapi, their tables, the engine's), and every burst of allocations sets off collections that scan them all
again: paused, a warm `jpaged serve` imports in 1.5-2.0 s against 2.1-2.5 s (scripts/KERNELS.md). `resume()` once
started (the server once it is ready, other commands once parsed), with the objects made so far frozen out of the
collector's sight (`gc.freeze`), so later collections scan only what serving creates.
"""

from __future__ import annotations

import gc

_paused = False


def pause() -> None:
    global _paused
    gc.disable()
    _paused = True


def resume() -> None:
    """Resume the collector `pause` paused (nothing where it did not: a library user's process, a test's)."""
    global _paused
    if _paused:
        gc.freeze()
        gc.enable()
        _paused = False
