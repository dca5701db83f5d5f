"""How the model multiplies by its weights (models/llama.py injects them at call time): the MatrixProducts protocol
a weight layout implements, the gated MLP's activations, and StackedProducts, XLA's dots on the weights as the
loaders build them. Other layouts live beside their kernels (runner/weight_layout.py's CPU panels,
models/quantized.py's quantized matrices)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import jax
import jax.numpy as jnp

from jpaged.models.activations import act_and_mul
from jpaged.models.config import ModelConfig
from jpaged.models.experts import routed_experts
from jpaged.models.fused_columns import group_fused_columns

# Each layer matrix by the name the products know it by, and its path in a DecoderLayer's state.
LAYER_MATRICES = {
    "qkv": ("attn", "qkv"),
    "o": ("attn", "o"),
    "gate_up": ("mlp", "gate_up"),
    "down": ("mlp", "down"),
}


class WholeLeaf:
    """A pytree of arrays that stands in the place of one weight array in the model's state (a quantized matrix):
    the layer scan slices its arrays like any leaf, and the modules hand it whole to the products."""

    def __getitem__(self, index):
        """Itself for `[...]`, which is how an nnx.Param hands over its value."""
        if index is not Ellipsis:
            raise TypeError(f"a {type(self).__name__} is read whole ([...])")
        return self


# A mixture of experts' stacks (models/moe.py), by the name the products know them by, and their paths.
EXPERT_MATRICES = {"experts_gate_up": ("mlp", "experts_gate_up"), "experts_down": ("mlp", "experts_down")}


def layer_matrices(layers: dict) -> dict[str, tuple[str, str]]:
    """The LAYER_MATRICES a model's layers (its state's "layers" tree) hold: a mixture of experts has no dense
    MLP (models/moe.py)."""
    return {name: path for name, path in LAYER_MATRICES.items() if path[1] in layers.get(path[0], {})}


def is_whole_leaf(x) -> bool:
    """Whether `x` is a WholeLeaf (for tree functions' `is_leaf`: a quantized matrix is one leaf, not its arrays)."""
    return isinstance(x, WholeLeaf)


class MatrixProducts(Protocol):
    """How the model multiplies by its weights, for one layout of them. `rows` is how many leading rows of x are
    live (the rest is padding, which a layout may skip and leave zero)."""

    # Layer matrices the layer scan hands over whole (with the layer's index) instead of sliced to one layer.
    whole_matrices: tuple[str, ...]
    # How many runs the fused matrices' columns come in (`group_fused_columns`): one per tensor-parallel shard,
    # so that each shard's columns hold whole heads of q, k and v and matching columns of gate and up.
    fused_groups: int

    def layout(self, params: dict) -> dict:
        """The loaders' params with some leaves rearranged as these products read them (same tree; done once,
        before the steps)."""
        ...

    def embed(self, weight: jax.Array, token_ids: jax.Array) -> jax.Array: ...

    def layer(
        self, name: str, weight: jax.Array, x: jax.Array, layer: jax.Array, rows: jax.Array
    ) -> jax.Array:
        """x @ layer `layer`'s matrix `name` (a LAYER_MATRICES key); `weight` is that layer's matrix, or the whole
        stack where `name` is in `whole_matrices`."""
        ...

    def gated(
        self,
        weight: jax.Array,
        x: jax.Array,
        layer: jax.Array,
        rows: jax.Array,
        sizes: tuple[int, int],
        activation: str,
    ) -> jax.Array:
        """The MLP's activation act(x @ gate) * (x @ up) from layer `layer`'s gate_up matrix (as `layer` takes
        it), gate and up `sizes` wide, computed as `act_and_mul` computes it."""
        ...

    def experts_gated(
        self,
        weight: jax.Array,
        x: jax.Array,
        group_sizes: jax.Array,
        layer: jax.Array,
        activation,
        bias: jax.Array | None = None,
    ) -> jax.Array:
        """Rows of x sorted by expert, group_sizes[e] of them expert e's (in expert order; rows past them are no
        expert's and may be left anything), each run's act(x @ gate) * (x @ up) by its expert's gate|up in
        `weight`: layer `layer`'s experts_gate_up [E, D, 2F] (or the whole stack, where the products take the
        experts whole); `bias` [rows, 2F] added to the product before the activation (activations.act_and_mul's:
        a name, or a ClampedSwiGLU)."""
        ...

    def experts_down(
        self, weight: jax.Array, x: jax.Array, group_sizes: jax.Array, layer: jax.Array
    ) -> jax.Array:
        """Each run of rows (as `experts_gated` takes them) times its expert's down matrix in `weight`."""
        ...

    def mixture(
        self,
        x: jax.Array,
        weights: jax.Array,
        experts: jax.Array,
        gate_up: jax.Array,
        down: jax.Array,
        layer: jax.Array,
        live: jax.Array,
        activation,
        biases: tuple[jax.Array, jax.Array] | None = None,
    ) -> jax.Array:
        """Each live token's (`live` [T]) weighted sum of its routed experts' gated MLPs (experts.routed_experts:
        `weights` and `experts` [T, k], layer `layer`'s expert stacks gate_up [E, D, 2F] and down [E, F, D], and
        where the experts have them, their biases [E, 2F] and [E, D]); where the experts lie (one device, or split
        over a mesh) is the products' concern."""
        ...

    def lm_head(self, weight: jax.Array, h: jax.Array, rows: jax.Array, *, tied: bool) -> jax.Array:
        """float32 logits [R, V] of the final hidden states h [R, D]; `weight` is the embedding when tied."""
        ...


@dataclass(frozen=True)
class StackedProducts:
    """XLA's dots on the weights as the loaders build them (layer matrices stacked, sliced per layer by the scan);
    with `fused_groups` > 1, the fused matrices' columns grouped per tensor-parallel shard."""

    config: ModelConfig | None = None  # needed when fused_groups > 1
    fused_groups: int = 1
    whole_matrices: tuple[str, ...] = ()

    def layout(self, params: dict) -> dict:
        return self.hold(self.arrange(params))

    def arrange(self, params: dict) -> dict:
        """The loaders' params with the fused matrices' columns where the step reads them (tensor parallelism
        places each device's columns straight from the loaders' arrays instead: tensor_parallel.place_sharded)."""
        return (
            group_fused_columns(params, self.config, self.fused_groups) if self.fused_groups > 1 else params
        )

    def hold(self, params: dict) -> dict:
        """The arranged params as these products hold them (quantized, for QuantizedProducts); done where the
        arranged ones are, on the host or on each device's shard."""
        return params

    def embed(self, weight: jax.Array, token_ids: jax.Array) -> jax.Array:
        return weight[token_ids]

    def layer(self, name, weight, x, layer, rows) -> jax.Array:
        return x @ weight

    def gated(self, weight, x, layer, rows, sizes, activation) -> jax.Array:
        return act_and_mul(
            self.layer("gate_up", weight, x, layer, rows), sizes, self.fused_groups, activation
        )

    def experts_gated(self, weight, x, group_sizes, layer, activation, bias=None) -> jax.Array:
        width = weight.shape[-1]
        h = grouped_product(weight, x, group_sizes)
        h = h if bias is None else h + bias
        return act_and_mul(h, (width // 2, width // 2), self.fused_groups, activation)

    def experts_down(self, weight, x, group_sizes, layer) -> jax.Array:
        return grouped_product(weight, x, group_sizes)

    def mixture(self, x, weights, experts, gate_up, down, layer, live, activation, biases=None) -> jax.Array:
        return routed_experts(
            x,
            weights,
            experts,
            gate_up.shape[-3],
            live=live,
            gated=lambda rows, sizes, bias: self.experts_gated(gate_up, rows, sizes, layer, activation, bias),
            down=lambda h, sizes: self.experts_down(down, h, sizes, layer),
            biases=biases,
        )

    def lm_head(self, weight: jax.Array, h: jax.Array, rows: jax.Array, *, tied: bool) -> jax.Array:
        return jnp.dot(h, weight.T if tied else weight, preferred_element_type=jnp.float32)


def grouped_product(weight: jax.Array, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """XLA's grouped matrix product (`jax.lax.ragged_dot`): each run of rows times its group's matrix."""
    return jax.lax.ragged_dot(x, weight, group_sizes)


STACKED = StackedProducts()
