"""Layer matrices held group-quantized, as a checkpoint ships them (GGUF's Q4_0, Q4_1 and Q8_0 blocks kept as
blocks): `GroupedMatrix` holds integer codes and, for each group of G consecutive inputs of an output column, a scale
and a bias, w[k, n] = scale[k // G, n] * codes[k, n] + bias[k // G, n].

A GroupedMatrix is a pytree in the place of a float leaf in the loaders' params and the model's state (the layer
scan slices its arrays like any leaf); the host-side loaders transpose, join and stack it with `tree_map`.
`GroupedProducts` multiplies by it the XLA way, dequantise-then-dot in the model's dtype: the accelerators' form
until they have kernels of their own, and the reference the CPU kernel (jpaged/pallas/cpu/grouped_matmul.py) is
held to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.models.products import StackedProducts, WholeLeaf


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class GroupedMatrix(WholeLeaf):
    """A matrix [..., K, N]: codes (uint8 or int8, `bits` significant) [..., K, N], scale and bias (float16 or
    float32) [..., K / G, N]."""

    codes: jax.Array | np.ndarray
    scale: jax.Array | np.ndarray
    bias: jax.Array | np.ndarray
    bits: int = field(default=8, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    @property
    def group_size(self) -> int:
        return self.codes.shape[-2] // self.scale.shape[-2]

    @property
    def T(self) -> GroupedMatrix:  # noqa: N802 (numpy's name)
        """From transformers' [out, in] (groups along `in`) to the model's [in, out], as a float weight is."""
        return jax.tree_util.tree_map(lambda a: np.swapaxes(a, -1, -2), self)


GROUPED_FIELDS = ("codes", "scale", "bias")  # the arrays of a GroupedMatrix


def is_grouped(leaf) -> bool:
    return isinstance(leaf, GroupedMatrix)


def dequantize(matrix: GroupedMatrix, dtype) -> jax.Array:
    """The float matrix [..., K, N] in `dtype`, computed in float32 and rounded once."""
    g = matrix.group_size
    scale = jnp.repeat(jnp.asarray(matrix.scale, jnp.float32), g, axis=-2)
    bias = jnp.repeat(jnp.asarray(matrix.bias, jnp.float32), g, axis=-2)
    return (jnp.asarray(matrix.codes).astype(jnp.float32) * scale + bias).astype(dtype)


def host_dequantized(matrix: GroupedMatrix) -> np.ndarray:
    """The float32 matrix on the host (numpy)."""
    g = matrix.group_size
    scale, bias = (np.repeat(np.asarray(a, np.float32), g, axis=-2) for a in (matrix.scale, matrix.bias))
    return np.asarray(matrix.codes, np.float32) * scale + bias


def joined_columns(parts: list) -> GroupedMatrix | None:
    """Matrices [K, N_i] side by side (q|k|v, gate|up) as one GroupedMatrix, or None where they are not all
    GroupedMatrix of one form (bits, dtypes, group size): a checkpoint may mix block types."""
    first = parts[0]
    form = (first.bits, first.codes.dtype, first.scale.dtype, first.group_size) if is_grouped(first) else None
    for part in parts:
        if not is_grouped(part) or (part.bits, part.codes.dtype, part.scale.dtype, part.group_size) != form:
            return None
    return jax.tree_util.tree_map(lambda *columns: np.concatenate(columns, axis=-1), *parts)


@dataclass(frozen=True)
class GroupedProducts(StackedProducts):
    """XLA's dots on the layer matrices dequantised where they are used (GroupedMatrix leaves; float ones, and the
    embedding and LM head, as StackedProducts multiplies them)."""

    def layer(self, name, weight, x, layer, rows) -> jax.Array:
        if is_grouped(weight):
            return x @ dequantize(weight, x.dtype)
        return super().layer(name, weight, x, layer, rows)


GROUPED = GroupedProducts()
