"""The gated MLP's activations and its act(gate) * up, shared by the dense MLP's products (products.py) and the
experts' (experts.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jpaged.models.fused_columns import split_fused

# The gated MLP's activations by ModelConfig.hidden_activation (transformers' silu and gelu_pytorch_tanh).
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's experts' activation (transformers' GptOssExperts._apply_gate): the gate clamped from above and up
    on both sides at `limit`, then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float
    limit: float

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))


def act_and_mul(
    gate_up: jax.Array, sizes: tuple[int, int], fused_groups: int, activation: str | ClampedSwiGLU = "silu"
) -> jax.Array:
    """act(gate) * up of a gate|up product (or a ClampedSwiGLU of both). The activation in float32, rounded once, as
    torch's does for bfloat16: XLA's bfloat16 SiLU rounds after every op, each rounding a conversion of its own on
    CPU."""
    gate, up = split_fused(gate_up, sizes, fused_groups)
    if isinstance(activation, ClampedSwiGLU):
        return activation(gate, up)
    return ACTIVATIONS[activation](gate.astype(jnp.float32)).astype(gate.dtype) * up
