"""What a dispatched step gives back to the host: its sampled rows (and prompt logprobs), on their way as the host
goes on (async dispatch)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from jpaged.runner.sampling_inputs import SamplerOutput


@dataclass(slots=True)
class StepOutput:
    """What a step brings back to the host: the sampled rows and, when asked, the prompt logprobs of every token,
    values and ids [T, 1 + K] (the target, then the top K) and the target's rank [T]."""

    sampled: SamplerOutput
    prompt_logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    expert_load: np.ndarray | None = None  # the step's expert-load histogram (expert_load.py)


class PendingOutput:
    """A dispatched step's outputs on their way to the host: `result()` waits for them."""

    def __init__(self, sampled, prompt_logprobs, expert_load=None) -> None:
        self._arrays = (sampled, prompt_logprobs, expert_load)
        for leaf in jax.tree_util.tree_leaves(self._arrays):
            leaf.copy_to_host_async()

    def result(self) -> StepOutput:
        return StepOutput(*jax.tree_util.tree_map(np.asarray, self._arrays))
