"""How a mixture of experts routes tokens and combines its experts (moe.py's SparseMoE): each token's top-k experts
from the router's logits, and the experts' gated MLPs over the step's (token, expert) pairs sorted by expert, so a
grouped product multiplies each expert's run of rows by its matrices: no dense loop over every expert, no token
dropped, and the shapes fixed by the step's token count whatever the routing (the group sizes are data). The dense
form, every expert on every token, is the reference."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jpaged.models.activations import act_and_mul
from jpaged.models.config import ModelConfig


def route(logits: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Each token's top-k experts [T, k] (int32) and their weights [T, k] (logits' dtype) from the router's logits
    [T, E], as transformers' routers compute them: Qwen-MoE's and Mixtral's ("softmax_topk") a softmax in float32
    over every expert, the top k, renormalised to sum to 1 where the config says (Mixtral always); gpt-oss's
    ("topk_softmax") the top k logits, then a softmax over them in the logits' dtype."""
    if config.router == "topk_softmax":
        top, experts = jax.lax.top_k(logits, config.num_experts_per_tok)
        return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, experts = jax.lax.top_k(probs, config.num_experts_per_tok)
    if config.norm_topk_prob:
        top = top / top.sum(axis=-1, keepdims=True)
    return top.astype(logits.dtype), experts.astype(jnp.int32)


def routed_experts(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    num_experts: int,
    *,
    live: jax.Array,
    gated: Callable[[jax.Array, jax.Array, jax.Array | None], jax.Array],
    down: Callable[[jax.Array, jax.Array], jax.Array],
    biases: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]) for every live token t (padding rows give 0): the (token,
    expert) pairs sorted by expert, so `gated(rows, group_sizes, bias)` (act(x @ gate + bias) * (x @ up + bias) of
    each expert's run of rows, `bias` each row's expert's gate|up bias or None) and `down(h, group_sizes)` multiply
    each run by its expert's matrices; `biases` are the experts' gate_up [E, 2F] and down [E, D] biases (gpt-oss).
    Pairs of padding tokens sort past every group and are computed by none."""
    num_tokens, k = experts.shape
    expert_of = _pair_experts(experts, live, num_experts)
    order = jnp.argsort(expert_of, stable=True)
    token_of = order // k
    group_sizes = _group_sizes(expert_of, num_experts)
    row_expert = jnp.minimum(expert_of[order], num_experts - 1)  # each sorted row's expert (padding: any)
    gate_up_bias = None if biases is None else biases[0][row_expert]
    y = down(gated(x[token_of], group_sizes, gate_up_bias), group_sizes)
    if biases is not None:
        y = y + biases[1][row_expert]
    pair_weight = jnp.where(live[token_of], weights.reshape(-1)[order], 0).astype(y.dtype)
    y = jnp.where(pair_weight[:, None] != 0, y * pair_weight[:, None], 0)
    return jnp.zeros((num_tokens, y.shape[-1]), y.dtype).at[token_of].add(y)


def expert_counts(experts: jax.Array, live: jax.Array, num_experts: int) -> jax.Array:
    """How many of the step's live tokens each expert took [E] (what the load-imbalance histogram counts)."""
    return _group_sizes(_pair_experts(experts, live, num_experts), num_experts)


def _pair_experts(experts: jax.Array, live: jax.Array, num_experts: int) -> jax.Array:
    """Each (token, expert) pair's expert [T * k], a padding token's pairs past the last one (`num_experts`)."""
    return jnp.where(live[:, None], experts, num_experts).reshape(-1)


def _group_sizes(expert_of: jax.Array, num_experts: int) -> jax.Array:
    """How many pairs each expert takes [E] (int32; the pairs past the last counted by none)."""
    return jnp.bincount(expert_of, length=num_experts + 1)[:num_experts].astype(jnp.int32)


def dense_experts(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    activation,
    biases: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """The same sum with every expert computed on every token and weighted by its routing weight (0 where not
    chosen): the reference the grouped form is tested and benchmarked against."""
    num_experts, _, width = gate_up.shape
    h = jnp.einsum("td,edf->etf", x, gate_up)
    h = h if biases is None else h + biases[0][:, None]
    h = act_and_mul(h, (width // 2, width // 2), 1, activation)
    y = jnp.einsum("etf,efd->etd", h, down)
    y = y if biases is None else y + biases[1][:, None]
    chosen = jax.nn.one_hot(experts, num_experts, dtype=weights.dtype) * weights[..., None]  # [T, k, E]
    return jnp.einsum("etd,te->td", y, chosen.sum(axis=1).astype(y.dtype))
