"""A progressive warm-up seen from the engine: the runners' step limits carried into the scheduler as their
background stages land (runner/warmup_stages.py), and the counts the metrics report.

With a draft model both runners warm up in stages, and a step must fit the programs of both: the scheduler gets
the lower of their limits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jpaged.engine.engine_metrics import ProgramCounts

if TYPE_CHECKING:
    from jpaged.core.scheduler import Scheduler
    from jpaged.runner.model_runner import ModelRunner


class WarmupProgress:
    def __init__(self, runners: list[ModelRunner], scheduler: Scheduler) -> None:
        self._runners, self._scheduler = runners, scheduler
        self._limit_scheduler()

    def follow(self) -> None:
        """Take the stages that landed since the last call (from the engine's thread, between steps)."""
        # A list, not a generator: every runner takes its stages, whichever rose first.
        if self.remaining and any([runner.take_landed_stages() for runner in self._runners]):
            self._limit_scheduler()

    def engine_idle(self, idle: bool) -> None:
        """Whether the engine has no request to step (the KV pools are mapped in only while it has none)."""
        for runner in self._runners:
            runner.engine_idle(idle)

    def wait(self, timeout: float = 0.1) -> None:
        """For an engine with requests but no step it may build yet: wait for a stage to land rather than spin."""
        for runner in self._runners:
            if runner.background_warmup is not None:
                runner.background_warmup.wait(timeout)
                return

    def stop(self) -> None:
        """Compile no further stage (an engine shutting down)."""
        for runner in self._runners:
            if runner.background_warmup is not None:
                runner.background_warmup.stop()

    @property
    def remaining(self) -> int:
        """Programs the background warm-ups have still to hand over."""
        return sum(runner.warmup_programs_remaining for runner in self._runners)

    def counts(self) -> ProgramCounts:
        target = self._runners[0]
        return ProgramCounts(target.num_compilations, target.programs.num_live_compilations, self.remaining)

    def _limit_scheduler(self) -> None:
        tokens, seqs = zip(*(runner.step_limits for runner in self._runners), strict=True)
        self._scheduler.limit_steps(min(tokens), min(seqs))
