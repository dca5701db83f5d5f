"""The gated MLP's activations and its act(gate) * up, shared by the dense MLP's products (products.py) and the
experts' (experts.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jpaged.models.fused_columns import split_fused

# The gated MLP's activations by ModelConfig.hidden_activation (transformers' silu and gelu_pytorch_tanh).
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


def act_and_mul(
    gate_up: jax.Array, sizes: tuple[int, int], fused_groups: int, activation: str = "silu"
) -> jax.Array:
    """act(gate) * up of a gate|up product. The activation in float32, rounded once, as torch's does for bfloat16:
    XLA's bfloat16 SiLU rounds after every op, each rounding a conversion of its own on CPU."""
    gate, up = split_fused(gate_up, sizes, fused_groups)
    return ACTIVATIONS[activation](gate.astype(jnp.float32)).astype(gate.dtype) * up
