"""Holding an AsyncLLMEngine's loop in tests, so that no test races the machine's speed.

A test that needs a request still running when something happens (a client giving up, a grace period ending, a
server at capacity refusing more) holds the engine rather than hoping that generation is slower than the client
or a timeout: on a fast machine the request would finish first, on a slow one the test would wait for nothing.
"""

from __future__ import annotations

import threading
import time

from jpaged.engine.async_engine import AsyncLLMEngine


class EngineGate:
    """Parks the engine loop before a step until `release()`, and records every abort asked for meanwhile.

    `steps` steps with outputs run first (a stream's first event needs one; with async scheduling a step's
    outputs come from the step after it), then the loop parks before the next. While parked
    the engine lock is free, as it is between two steps: requests can still be added, aborted and measured, they
    just make no progress. Entering patches the engine's step and abort (instance attributes only); leaving
    releases the loop and restores them."""

    def __init__(self, engine: AsyncLLMEngine, *, steps: int = 0) -> None:
        self._engine = engine
        self._steps_before_parking = steps
        self._open = threading.Event()
        self._aborts_changed = threading.Condition()
        self.parked = threading.Event()  # the loop has reached the step it waits at
        self.aborts: list[str] = []  # request ids, in the order their aborts were asked for

    def __enter__(self) -> EngineGate:
        step, abort = self._engine.engine.step, self._engine.abort

        def gated_step():
            if not self._steps_before_parking and not self._open.is_set():
                self._park()
            outputs = step()
            if self._steps_before_parking and outputs:
                self._steps_before_parking -= 1
            return outputs

        def recorded_abort(request_id: str) -> None:
            with self._aborts_changed:
                self.aborts.append(request_id)
                self._aborts_changed.notify_all()
            abort(request_id)

        self._engine.engine.step = gated_step
        self._engine.abort = recorded_abort
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()
        del self._engine.engine.step, self._engine.abort

    def release(self) -> None:
        """Let the loop step on; an abort asked for while it was parked takes effect after one more step."""
        self._open.set()

    def wait_for_aborts(self, count: int = 1, timeout: float = 60.0) -> list[str]:
        """The first `count` aborts once they were asked for; `timeout` only guards against a hang."""
        with self._aborts_changed:
            asked = self._aborts_changed.wait_for(lambda: len(self.aborts) >= count, timeout)
        assert asked, f"{count} aborts expected within {timeout} s, got {self.aborts}"
        return self.aborts[:count]

    def _park(self) -> None:
        # The loop holds the engine lock around step(); letting go of it here makes the wait look like the
        # time between two steps, so adding a request or reading metrics does not wait for the release.
        lock = self._engine._lock
        lock.release()
        self.parked.set()
        try:
            self._open.wait()
        finally:
            lock.acquire()


def wait_until(condition, timeout: float = 60.0, message: str = "") -> None:
    """Poll `condition` until true; `timeout` only guards against a hang (the state must come)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message or f"{condition} still false after {timeout} s"
        time.sleep(0.01)
