"""How evenly a mixture of experts' experts are loaded, as a histogram the step computes on the device: each
(layer, expert) of a step is one observation, the number of the step's tokens it took. The buckets' counts and the
observations' sum come back to the host with the step's sampled tokens (no transfer of their own), where the engine
adds them up (engine_metrics.ExpertLoad) for the server's Prometheus histogram."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The buckets' upper bounds (Prometheus' `le`), then +Inf: 0, 1, 2, 4, ... 65536 tokens.
BUCKETS = (0, *(2**i for i in range(17)))


def load_histogram(counts: jax.Array) -> jax.Array:
    """int32 [len(BUCKETS) + 2]: how many of `counts` [L, E] fall in each bucket (le BUCKETS[i], then past the
    last), and their sum (for a dense model, [L, 0]: all zero)."""
    bucket = jnp.searchsorted(jnp.asarray(BUCKETS, jnp.int32), counts.reshape(-1), side="left")
    histogram = jnp.bincount(bucket, length=len(BUCKETS) + 1).astype(jnp.int32)
    return jnp.concatenate([histogram, counts.sum(dtype=jnp.int32).reshape(1)])
