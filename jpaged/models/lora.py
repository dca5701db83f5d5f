"""LoRA adapters on the device: each token's delta (x A) B from its adapter's slot.

The engine holds every adapter it serves at once in fixed-shape stacks, one pair a layer matrix (LAYER_MATRICES):
A [L, S, in, W] and B [L, S, W, out] for S device slots, W = parts x max_lora_rank (models/lora_weights.py lays an
adapter out: fused matrices' parts side by side in A, block-diagonal in B, its scale folded into B, B's columns
arranged as the base matrix's). A step names each token's slot in `StepBatch.lora_slots` (0: no adapter, s: stack
row s - 1), so a batch mixes adapters and the base model freely, and loading, swapping or mixing adapters never
changes a shape: nothing compiles.

Three ways to compute the per-token delta (scripts/bench_lora.py measures them):
  dense    every slot's x A on every token, each token keeping its own slot's, then one product by B: reads every
           slot's matrices, S x W columns of extra work a token; no gather, no sort
  gather   each token's own slot's A and B gathered [T, in, W] (punica's BGMV): the least arithmetic, a copy of
           the matrices a token
  grouped  tokens sorted by slot, two grouped products (jax.lax.ragged_dot; punica's SGMV), unsorted back
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

from jpaged.models.products import grouped_product

LORA_METHODS = ("dense", "gather", "grouped")
ADAPTERS = "lora"  # the adapter stacks' key beside the model's state in the step's weights (split_adapters)


def split_adapters(weights: dict) -> tuple[dict, dict | None]:
    """The step's weights as (the model's state, the adapter stacks or None): the runner hands both as one tree."""
    if ADAPTERS not in weights:
        return weights, None
    return {key: value for key, value in weights.items() if key != ADAPTERS}, weights[ADAPTERS]


@dataclass(frozen=True)
class XlaLoRA:
    """The stacks as A [L, S, in, W] and B [L, S, W, out], sliced to a layer by the layer scan; the deltas by XLA in
    one of LORA_METHODS. What the step reads except on a CPU with the C++ matmul kernel (runner/lora_panels.py)."""

    method: str = "dense"
    whole_stacks: ClassVar[bool] = False  # the scan slices the stacks to the layer

    def shapes(self, fan_in: int, width: int, fan_out: int, layers: int, slots: int) -> tuple[tuple, tuple]:
        return (layers, slots, fan_in, width), (layers, slots, width, fan_out)

    def write(self, stacks: dict, row: jax.Array, adapter: dict) -> dict:
        """Stack row `row` set to one adapter's arrays (name -> {"a": [L, in, W], "b": [L, W, out]})."""
        return jax.tree_util.tree_map(
            lambda stack, new: stack.at[:, row].set(new.astype(stack.dtype)), stacks, adapter
        )

    def delta(self, name: str, x: jax.Array, stacks: dict, slots: jax.Array, layer, rows) -> jax.Array:
        return lora_delta(x, stacks["a"], stacks["b"], slots, self.method)


XLA_LORA = XlaLoRA()


def lora_delta(
    x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array, method: str = "dense"
) -> jax.Array:
    """Each token's (x A) B by its slot's matrices: x [T, in], one layer's stacks a [S, in, W] and b [S, W, out],
    slots [T] (0: none, whose delta is 0). In x's dtype."""
    if method == "dense":
        return _dense(x, a, b, slots)
    if method == "gather":
        return _gather(x, a, b, slots)
    if method == "grouped":
        return _grouped(x, a, b, slots)
    raise ValueError(f"method must be one of {LORA_METHODS}, got {method!r}")


def _dense(x, a, b, slots):
    num_slots, _, width = a.shape
    xa = jnp.einsum("ti,siw->tsw", x, a)
    own = (slots[:, None] == jnp.arange(1, num_slots + 1)[None, :]).astype(x.dtype)
    return (xa * own[:, :, None]).reshape(x.shape[0], num_slots * width) @ b.reshape(num_slots * width, -1)


def _gather(x, a, b, slots):
    row = jnp.maximum(slots - 1, 0)
    xa = jnp.einsum("ti,tiw->tw", x, a[row]) * (slots > 0)[:, None].astype(x.dtype)
    return jnp.einsum("tw,two->to", xa, b[row])


def _grouped(x, a, b, slots):
    num_slots = a.shape[0]
    # No adapter sorts past every slot: those rows are no group's, and zeroed.
    order = jnp.argsort(jnp.where(slots > 0, slots, num_slots + 1), stable=True)
    sizes = jnp.bincount(slots, length=num_slots + 1)[1:].astype(jnp.int32)
    xa = grouped_product(a, x[order], sizes)
    out = grouped_product(b, xa, sizes)
    out = jnp.where((jnp.arange(x.shape[0]) < jnp.sum(sizes))[:, None], out, 0)
    return jnp.zeros_like(out).at[order].set(out)
