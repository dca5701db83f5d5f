"""The mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral): a router picks each token's top-k experts and the
products combine their gated MLPs (experts.py; MatrixProducts.mixture, which knows where the experts lie).
Qwen2-MoE adds a shared expert every token takes, scaled by a sigmoid gate.

State (a DecoderLayer's `mlp`, every leaf stacked on the layers' leading L axis): router [D, E], experts_gate_up
[E, D, 2F] (each expert's gate|up), experts_down [E, F, D]; gpt-oss's router_bias [E], experts_gate_up_bias
[E, 2F] and experts_down_bias [E, D]; the shared expert's shared_gate_up [D, 2Fs], shared_down [Fs, D] and
shared_gate [D, 1]. E experts, F an expert's MLP size, Fs the shared expert's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from jpaged.models.activations import ClampedSwiGLU, act_and_mul
from jpaged.models.config import ModelConfig
from jpaged.models.experts import expert_counts, route

if TYPE_CHECKING:
    from jpaged.models.llama import StepContext

EXPERTS = "experts"  # the experts' logical axis (expert parallelism splits it)


class SparseMoE(nnx.Module):
    def __init__(self, config: ModelConfig, dtype) -> None:
        from jpaged.models.llama import EMBED, MLP, _weight  # llama.py builds this module

        c = self.config = config
        d, e, f = c.hidden_size, c.num_experts, c.expert_intermediate_size
        self.router = _weight((d, e), dtype, (EMBED, None))
        self.experts_gate_up = _weight((e, d, 2 * f), dtype, (EXPERTS, EMBED, MLP))
        self.experts_down = _weight((e, f, d), dtype, (EXPERTS, MLP, EMBED))
        biased = c.expert_bias
        self.router_bias = _weight((e,), dtype, (None,)) if biased else None
        self.experts_gate_up_bias = _weight((e, 2 * f), dtype, (EXPERTS, MLP)) if biased else None
        self.experts_down_bias = _weight((e, d), dtype, (EXPERTS, EMBED)) if biased else None
        fs = c.shared_expert_intermediate_size
        self.shared_gate_up = _weight((d, 2 * fs), dtype, (EMBED, MLP)) if fs else None
        self.shared_down = _weight((fs, d), dtype, (MLP, EMBED)) if fs else None
        self.shared_gate = _weight((d, 1), dtype, (EMBED, None)) if fs else None

    def __call__(self, x: jax.Array, layer: jax.Array, step: StepContext) -> tuple[jax.Array, jax.Array]:
        """The block's output [T, D], and how many of the step's live tokens each expert took [E]."""
        c = self.config
        logits = x @ self.router[...]
        weights, experts = route(logits if self.router_bias is None else logits + self.router_bias[...], c)
        live = jnp.arange(x.shape[0]) < step.live_tokens
        gate_up, down = self.experts_gate_up[...], self.experts_down[...]
        biases = None
        if self.experts_gate_up_bias is not None:
            biases = (self.experts_gate_up_bias[...], self.experts_down_bias[...])
        out = step.products.mixture(
            x, weights, experts, gate_up, down, layer, live, expert_activation(c), biases
        )
        counts = expert_counts(experts, live, c.num_experts)
        if self.shared_gate_up is None:
            return out, counts
        fs = c.shared_expert_intermediate_size
        groups = step.products.fused_groups
        shared = act_and_mul(x @ self.shared_gate_up[...], (fs, fs), groups, c.hidden_activation)
        gate = jax.nn.sigmoid(x @ self.shared_gate[...])
        return out + gate * (shared @ self.shared_down[...]), counts


def expert_activation(config: ModelConfig) -> str | ClampedSwiGLU:
    """The experts' activation as activations.act_and_mul takes it."""
    if config.hidden_activation == "clamped_swiglu":
        return ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)
    return config.hidden_activation
