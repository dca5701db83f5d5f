"""What the sampler tests share: a vocabulary of V tokens, the sampler's fixed widths for it, rows of one kind of
request, and the wide fields the host leaves out filled in as the runner does."""

from __future__ import annotations

import jax

from jpaged.runner.sampler import sample
from jpaged.runner.sampling_inputs import (
    WIDE_FIELDS,
    SamplingRow,
    SamplingTensors,
    SamplingWidths,
    neutral_wide,
)
from jpaged.sampling_params import SamplingParams

V = 1024  # several blocks of the two-level draw, and more than the first top_k/top_p candidate tier
WIDTHS = SamplingWidths(V, history_len=64)
jitted_sample = jax.jit(sample, static_argnames=("branch_free",))


def with_neutral_wide(tensors: SamplingTensors) -> SamplingTensors:
    """The wide fields the host left out, neutral (what the runner passes from the device)."""
    neutral = neutral_wide(len(tensors.temperature), WIDTHS)
    return tensors._replace(**{f: neutral[f] for f in WIDE_FIELDS if getattr(tensors, f) is None})


def rows_of(
    params: SamplingParams, n: int, outputs: list[int] | None = None, prompt=(1, 2, 3)
) -> list[SamplingRow]:
    return [SamplingRow(params, list(prompt), list(outputs or []), seed=1000 + i) for i in range(n)]
