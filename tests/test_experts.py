"""Routing and combining a mixture of experts (models/experts.py), on fresh random inputs against a float64 numpy
oracle: the router's top-k as transformers computes it, and the grouped form (pairs sorted by expert, one grouped
product a matrix) equal to the dense form (every expert on every token) whatever the routing: skewed onto one
expert, experts no token takes, padding rows that must take none."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.models.config import ModelConfig
from jpaged.models.experts import dense_experts, expert_counts, route
from jpaged.models.products import STACKED

E, K, D, F = 6, 2, 16, 8


def config(norm_topk_prob: bool) -> ModelConfig:
    return ModelConfig(
        "qwen3_moe", 100, D, 32, 1, 2, 1, 8, 1e-6, 1e4, 64,
        num_experts=E, num_experts_per_tok=K, expert_intermediate_size=F, norm_topk_prob=norm_topk_prob,
    )  # fmt: skip


def numpy_oracle(x, experts, weights, gate_up, down, live) -> np.ndarray:
    """float64: for each live token, sum over its k experts of weight * down(silu(gate) * up)."""
    x, gate_up, down = (np.asarray(a, np.float64) for a in (x, gate_up, down))
    out = np.zeros((x.shape[0], down.shape[-1]))
    for t in np.flatnonzero(live):
        for e, w in zip(np.asarray(experts[t]), np.asarray(weights[t], np.float64), strict=True):
            gate, up = np.split(x[t] @ gate_up[e], 2)
            out[t] += w * ((gate / (1 + np.exp(-gate)) * up) @ down[e])
    return out


@pytest.mark.parametrize("norm", [False, True])
def test_route_takes_the_top_k_of_a_float32_softmax_renormalised_where_the_config_says(norm):
    logits = np.random.default_rng(1).standard_normal((9, E)).astype(np.float32) * 3
    weights, experts = route(jnp.asarray(logits), config(norm))
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[:, :K]
    expected = np.take_along_axis(probs, top, -1)
    expected = expected / expected.sum(-1, keepdims=True) if norm else expected
    np.testing.assert_array_equal(np.asarray(experts), top)
    np.testing.assert_allclose(np.asarray(weights), expected, rtol=1e-6)


@pytest.mark.parametrize("routing", ["random", "all_to_one", "half_unused"])
def test_grouped_experts_equal_the_dense_form_and_the_oracle_whatever_the_routing(routing):
    rng = np.random.default_rng({"random": 2, "all_to_one": 3, "half_unused": 4}[routing])
    tokens, live_tokens = 11, 8  # the last 3 rows are padding
    x = rng.standard_normal((tokens, D)).astype(np.float32)
    gate_up = (rng.standard_normal((E, D, 2 * F)) * 0.3).astype(np.float32)
    down = (rng.standard_normal((E, F, D)) * 0.3).astype(np.float32)
    experts = {
        "random": np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)]),
        "all_to_one": np.stack([[3, rng.integers(0, 3)] for _ in range(tokens)]),
        "half_unused": np.stack([rng.choice(E // 2, K, replace=False) for _ in range(tokens)]),
    }[routing].astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (tokens, K)).astype(np.float32)
    live = np.arange(tokens) < live_tokens

    grouped = jax.jit(functools.partial(STACKED.mixture, activation="silu"))(
        x, weights, experts, gate_up, down, jnp.int32(0), jnp.asarray(live)
    )
    dense = dense_experts(x, weights, experts, gate_up, down, "silu")
    expected = numpy_oracle(x, experts, weights, gate_up, down, live)
    np.testing.assert_allclose(np.asarray(grouped), expected, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(dense)[live], expected[live], atol=2e-5, rtol=2e-5)
    assert not np.asarray(grouped)[~live].any()  # padding takes no expert
    counts = np.asarray(expert_counts(jnp.asarray(experts), jnp.asarray(live), E))
    np.testing.assert_array_equal(counts, np.bincount(experts[live].ravel(), minlength=E))
