"""Expert parallelism (vLLM's --enable-expert-parallel): a mixture of experts' experts split whole over the
tensor-parallel mesh, E / tp of them a device with each expert's MLP unsplit, while attention (and a shared expert)
stays tensor-parallel. The weights never move: the step's tokens go to their experts' devices and the results come
back, in one of two forms, chosen by the step's token count (static, so each bucket compiles one program and
nothing is compiled after warm-up whatever the routing):

  * replicated tokens (vLLM's allgather_reducescatter): tensor parallelism leaves every device all T tokens after
    the attention's all-reduce, so each device computes just the (token, expert) pairs routed to its own experts
    (a contiguous run of the pairs sorted by expert) into a partial [T, D], and the devices sum them: the
    reduce-scatter and all-gather of that form, here one all-reduce;
  * all-to-all: each device takes T / tp of the tokens and sends each of their pairs to its expert's device, in a
    buffer of fixed capacity for each destination, large enough never to drop a pair (all of the device's T k / tp
    pairs: any routing fits), computes what it received, sends the results back and combines its own tokens,
    which an all-gather then hands to every device.

With every device holding all the tokens and no pair ever dropped, the all-to-all form moves k times the bytes of
the all-reduce and computes as many rows: scripts/bench_expert_parallel.py measures both (scripts/KERNELS.md), and
ALL_TO_ALL_FROM_TOKENS is what it found.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jpaged.models.config import ModelConfig
from jpaged.models.products import MatrixProducts
from jpaged.runner.tensor_parallel import AXIS

# The expert leaves whose columns stay as loaded (whole experts on each device): gate|up and its bias.
WHOLE_EXPERT_COLUMNS = ("experts_gate_up", "experts_gate_up_bias")
# The step's token count from which the mixture takes the all-to-all form (None: never); measured by
# scripts/bench_expert_parallel.py (scripts/KERNELS.md).
ALL_TO_ALL_FROM_TOKENS: int | None = None


def check_expert_parallel(size: int, config: ModelConfig) -> None:
    """Each device must hold whole experts, as many as every other: `size` divides the experts."""
    if config.num_experts % size:
        raise ValueError(
            f"enable_expert_parallel: tensor_parallel_size ({size}) must divide the model's "
            f"{config.num_experts} experts"
        )


def expert_parallel_products(products: MatrixProducts, mesh: Mesh, config: ModelConfig) -> MatrixProducts:
    """`products` (the tensor-parallel ones) with the mixture's experts split whole over `mesh`; a model without
    experts is left as it is (vLLM ignores the flag there too)."""
    if not config.num_experts:
        return products
    check_expert_parallel(mesh.shape[AXIS], config)
    return ExpertParallelProducts(products, mesh, ALL_TO_ALL_FROM_TOKENS)


@dataclass(frozen=True)
class ExpertParallelProducts:
    """`inner`'s products (tensor-parallel: fused columns grouped per device) but for the mixture, which runs
    under `jax.shard_map` on each device's own experts (the expert stacks split by experts: param_shardings
    with expert_parallel), tokens moved in the form the step's token count picks (module docstring). An expert's
    gate|up columns stay as loaded: each device holds whole experts, so no grouping per device is needed."""

    inner: MatrixProducts
    mesh: Mesh
    all_to_all_from: int | None = None  # tokens; None: always the replicated form

    def __getattr__(self, name: str):
        """Everything but the mixture and the arrangement is `inner`'s."""
        if name == "inner":  # not yet set (copying): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def layout(self, params: dict) -> dict:
        return self.inner.hold(self.arrange(params))

    def arrange(self, params: dict) -> dict:
        """`inner`'s arrangement of everything but the experts' gate|up (and its bias), kept as loaded."""
        mlp = params["layers"].get("mlp", {})
        kept = {name: mlp[name] for name in WHOLE_EXPERT_COLUMNS if name in mlp}
        rest = {name: leaf for name, leaf in mlp.items() if name not in kept}
        arranged = self.inner.arrange({**params, "layers": {**params["layers"], "mlp": rest}})
        arranged["layers"]["mlp"] = {**arranged["layers"]["mlp"], **kept}
        return arranged

    def form(self, num_tokens: int) -> str:
        """Which form a step of `num_tokens` tokens takes: "all_to_all" from `all_to_all_from` tokens on (when the
        devices split them evenly), else "replicated"."""
        size = self.mesh.shape[AXIS]
        split = self.all_to_all_from is not None and num_tokens >= self.all_to_all_from
        return "all_to_all" if split and num_tokens % size == 0 else "replicated"

    def mixture(self, x, weights, experts, gate_up, down, layer, live, activation, biases=None) -> jax.Array:
        local = dataclasses.replace(self.inner, fused_groups=1)  # an expert's columns are not grouped
        body = _all_to_all if self.form(x.shape[0]) == "all_to_all" else _replicated

        def on_devices(x, weights, experts, live, layer, gate_up, down, *biases):
            def on_own_experts(x, weights, experts, live):
                """The mixture of the pairs (`weights`, `experts` [R, k]) routed to this device's experts (local
                numbers; another device's are the local count, in no group, with weight 0)."""
                return local.mixture(
                    x, weights, experts, gate_up, down, layer, live, activation, biases or None
                )

            return body(on_own_experts, gate_up.shape[-3], x, weights, experts, live)

        def by_experts(stack, trailing: int) -> P:  # split along its experts axis, `trailing` axes after it
            return P(*(None,) * (stack.ndim - trailing - 1), AXIS)

        stacks = (gate_up, down, *(biases or ()))  # gpt-oss's experts have biases [E, 2F] and [E, D]
        # The tokens go in whole (as they are after the attention) even where each device takes a part: split
        # on the way in, XLA would carry the split back into the routing and gather it again there.
        sharded = jax.shard_map(
            on_devices,
            mesh=self.mesh,
            in_specs=(P(),) * 5 + tuple(by_experts(a, 2 if i < 2 else 1) for i, a in enumerate(stacks)),
            out_specs=P(),
            check_vma=False,
        )
        return sharded(x, weights, experts, live, layer, *stacks)


def _replicated(on_own_experts, num_local: int, x, weights, experts, live) -> jax.Array:
    """Every device holds all the tokens x [T, D] (weights, experts [T, k]): each sums the pairs of its
    `num_local` experts, and the devices add their sums."""
    first = jax.lax.axis_index(AXIS) * num_local
    own = (experts >= first) & (experts < first + num_local)
    local_experts = jnp.where(own, experts - first, num_local)
    partial = on_own_experts(x, jnp.where(own, weights, 0), local_experts, live)
    return jax.lax.psum(partial, AXIS)


def _all_to_all(on_own_experts, num_local: int, x, weights, experts, live) -> jax.Array:
    """Each device takes its T / tp of the tokens x [T, D] (weights, experts [T, k]): its t k pairs go to their
    experts' devices (`num_local` experts a device), in a [tp, t k, D] buffer (room for all of them at any one
    device), their results come back in the same slots, and the devices' combined tokens are gathered."""
    size = jax.lax.axis_size(AXIS)
    num_tokens, k = experts.shape[0] // size, experts.shape[1]
    first = jax.lax.axis_index(AXIS) * num_tokens
    x, weights, experts, live = (
        jax.lax.dynamic_slice_in_dim(a, first, num_tokens) for a in (x, weights, experts, live)
    )
    pairs = num_tokens * k
    device_of = jnp.where(live[:, None], experts // num_local, size).reshape(-1)  # padding: no device
    order = jnp.argsort(device_of, stable=True)
    device, token = device_of[order], order // k
    counts = jnp.bincount(device_of, length=size + 1)
    slot = jnp.arange(pairs) - (jnp.cumsum(counts) - counts)[device]  # its place in its device's run
    rows = jnp.zeros((size + 1, pairs, x.shape[-1]), x.dtype).at[device, slot].set(x[token])
    ids = (
        jnp.full((size + 1, pairs), num_local, jnp.int32)
        .at[device, slot]
        .set(experts.reshape(-1)[order] % num_local)
    )
    rows = jax.lax.all_to_all(rows[:size], AXIS, 0, 0)  # [tp, t k, D]: rows[s] what device s sent here
    ids = jax.lax.all_to_all(ids[:size], AXIS, 0, 0).reshape(-1)
    ones = jnp.ones((ids.shape[0], 1), weights.dtype)
    results = on_own_experts(rows.reshape(ids.shape[0], -1), ones, ids[:, None], ids < num_local)
    results = jax.lax.all_to_all(results.reshape(size, pairs, -1), AXIS, 0, 0)  # [tp, t k, D], as sent
    pair_weight = jnp.where(device < size, weights.reshape(-1)[order], 0).astype(results.dtype)[:, None]
    y = results[jnp.minimum(device, size - 1), slot]
    y = jnp.where(pair_weight != 0, y * pair_weight, 0)
    combined = jnp.zeros((num_tokens, y.shape[-1]), y.dtype).at[token].add(y)
    return jax.lax.all_gather(combined, AXIS, tiled=True)
