"""Matrices held group-quantized, as a checkpoint ships them (GGUF's Q4_0, Q4_1, Q8_0 and Q4_K blocks kept as
blocks): `GroupedMatrix` stores integer codes [..., K, N] and, for each group of G consecutive k of a column n, a
scale and a bias [..., K / G, N]: w[k, n] = scale[k // G, n] * codes[k, n] + bias[k // G, n].

A GroupedMatrix is a pytree in the place of a float leaf in the loaders' params and the model's state (the layer
scan slices its arrays like any leaf); the host-side loaders join and stack it with `tree_map`. It may stand for the
transpose of what it stores (`transposed`): an embedding [V, D] is stored as the LM head multiplies it, [D, V],
grouped along D, as a GGUF's rows are. `GroupedProducts` multiplies by it the XLA way, dequantise-then-dot in the
model's dtype: the accelerators' form until they have kernels of their own, and the reference the CPU kernel
(jpaged/pallas/cpu/grouped_matmul.py) is held to.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.models.products import StackedProducts, WholeLeaf

_STATIC = dict(static=True)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class GroupedMatrix(WholeLeaf):
    """codes (uint8 or int8, `bits` significant) [..., K, N], scale and bias (float16 or float32) [..., K / G, N];
    the matrix they make, or its transpose where `transposed`, stands for a float leaf of `dtype`."""

    codes: jax.Array | np.ndarray
    scale: jax.Array | np.ndarray
    bias: jax.Array | np.ndarray
    bits: int = field(default=8, metadata=_STATIC)
    transposed: bool = field(default=False, metadata=_STATIC)
    dtype: np.dtype = field(default=np.dtype(np.float32), metadata=_STATIC)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the matrix it stands for."""
        *lead, k, n = self.codes.shape
        return (*lead, n, k) if self.transposed else (*lead, k, n)

    @property
    def group_size(self) -> int:
        return self.codes.shape[-2] // self.scale.shape[-2]

    @property
    def T(self) -> GroupedMatrix:  # noqa: N802 (numpy's name)
        """The transpose, the same arrays seen the other way."""
        return dataclasses.replace(self, transposed=not self.transposed)

    def standing_for(self, dtype) -> GroupedMatrix:
        return dataclasses.replace(self, dtype=np.dtype(dtype))


def grouped_rows(
    codes: np.ndarray, scale: np.ndarray, bias: np.ndarray, bits: int, *, halves_if_exact: bool = True
) -> GroupedMatrix:
    """A checkpoint's [out, in] matrix (codes [out, in], scale and bias [out, in / G]: a GGUF's rows, an HF 4-bit
    format's) stored grouped along `in`, so transposed; scale and bias as float16 where that holds them exactly
    (and `halves_if_exact`: the K-quants' products are float32 whatever a tensor's values, so its form does not
    depend on them), else float32."""
    scale, bias = scale.astype(np.float32), bias.astype(np.float32)
    halves = [a.astype(np.float16) for a in (scale, bias)]
    if halves_if_exact and all(
        np.array_equal(h.astype(np.float32), a) for h, a in zip(halves, (scale, bias), strict=True)
    ):
        scale, bias = halves
    return GroupedMatrix(codes.T, scale.T, bias.T, bits, transposed=True)


GROUPED_FIELDS = ("codes", "scale", "bias")  # the arrays of a GroupedMatrix


@dataclass(frozen=True)
class LaidOutGroups(WholeLeaf):
    """A GroupedMatrix (a stack of them) laid out for a kernel (the CPU's panels, the GPU's packed codes): its
    codes, scale and bias rearranged, the code bits and the float dtype it stands for. Each layout registers its
    subclass as a pytree."""

    codes: jax.Array
    scale: jax.Array
    bias: jax.Array
    bits: int = field(metadata=_STATIC)
    dtype: np.dtype = field(metadata=_STATIC)

    def arrays(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        return self.codes, self.scale, self.bias


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PackedCodes(LaidOutGroups):
    """A 4-bit GroupedMatrix with its codes two to a byte, rows 2i and 2i + 1 in the low and high nibbles: what
    GroupedProducts holds and dequantises where used, in half the bytes of a code a byte. Split along its rows
    (tensor parallelism's row-parallel matrices), each device's part is still whole pairs."""

    transposed: bool = field(default=False, metadata=_STATIC)

    @classmethod
    def of(cls, matrix: GroupedMatrix) -> PackedCodes:
        codes = jnp.asarray(matrix.codes)
        packed = codes[..., 0::2, :] | (codes[..., 1::2, :] << 4)
        return cls(
            packed,
            jnp.asarray(matrix.scale),
            jnp.asarray(matrix.bias),
            matrix.bits,
            matrix.dtype,
            matrix.transposed,
        )

    @staticmethod
    def packs(matrix: GroupedMatrix) -> bool:
        """Whether its codes pack: 4-bit unsigned ones in even groups."""
        return matrix.bits == 4 and matrix.codes.dtype == np.uint8 and matrix.group_size % 2 == 0

    def unpacked(self) -> GroupedMatrix:
        *lead, half, n = self.codes.shape
        codes = jnp.stack([self.codes & 15, self.codes >> 4], axis=-2).reshape(*lead, 2 * half, n)
        return GroupedMatrix(codes, self.scale, self.bias, self.bits, self.transposed, self.dtype)


def is_grouped(leaf) -> bool:
    return isinstance(leaf, GroupedMatrix)


def _stored(weight):
    """A held weight as its GroupedMatrix (packed codes unpacked) or as it is."""
    return weight.unpacked() if isinstance(weight, PackedCodes) else weight


def _dequantized(matrix: GroupedMatrix, xp):
    """float32 w of the stored arrays with numpy or jax.numpy (`xp`), transposed where the matrix says."""
    g = matrix.group_size
    scale, bias = (
        xp.repeat(xp.asarray(a).astype(np.float32), g, axis=-2) for a in (matrix.scale, matrix.bias)
    )
    w = xp.asarray(matrix.codes).astype(np.float32) * scale + bias
    return xp.swapaxes(w, -1, -2) if matrix.transposed else w


def dequantize(matrix: GroupedMatrix, dtype=None) -> jax.Array:
    """The float matrix in `dtype` (default the one it stands for), computed in float32 and rounded once."""
    return _dequantized(matrix, jnp).astype(dtype or matrix.dtype)


def host_dequantized(matrix: GroupedMatrix) -> np.ndarray:
    """The float32 matrix on the host (numpy)."""
    return _dequantized(matrix, np)


def joined_columns(parts: list) -> GroupedMatrix | None:
    """Matrices [K, N_i] side by side (q|k|v, gate|up) as one GroupedMatrix, or None where they are not all
    GroupedMatrix of one form (bits, dtypes, group size, not transposed): a checkpoint may mix block types."""
    if len(parts) == 1:
        return parts[0] if is_grouped(parts[0]) else None
    first = parts[0]
    form = (first.bits, first.codes.dtype, first.scale.dtype, first.group_size) if is_grouped(first) else None
    for part in parts:
        if not is_grouped(part) or part.transposed:
            return None
        if (part.bits, part.codes.dtype, part.scale.dtype, part.group_size) != form:
            return None
    return jax.tree_util.tree_map(lambda *columns: np.concatenate(columns, axis=-1), *parts)


def embedding_rows(matrix: GroupedMatrix, token_ids: jax.Array) -> jax.Array:
    """Rows `token_ids` of an embedding [V, D] held transposed (stored [D, V]), dequantised: [T, D]."""
    if not matrix.transposed:
        raise ValueError("a grouped embedding is stored transposed, [D, V], grouped along D")
    columns = jax.tree_util.tree_map(lambda a: jnp.asarray(a)[..., token_ids], matrix)
    return dequantize(columns)


@dataclass(frozen=True)
class GroupedProducts(StackedProducts):
    """XLA's dots on GroupedMatrix leaves dequantised where they are used (float ones as StackedProducts
    multiplies them), 4-bit codes held two to a byte (PackedCodes)."""

    def hold(self, params: dict) -> dict:
        def held(leaf):
            return PackedCodes.of(leaf) if is_grouped(leaf) and PackedCodes.packs(leaf) else leaf

        return jax.tree_util.tree_map(held, params, is_leaf=is_grouped)

    def layer(self, name, weight, x, layer, rows) -> jax.Array:
        weight = _stored(weight)
        if is_grouped(weight):
            return x @ dequantize(weight, x.dtype)
        return super().layer(name, weight, x, layer, rows)

    def embed(self, weight, token_ids: jax.Array) -> jax.Array:
        weight = _stored(weight)
        return embedding_rows(weight, token_ids) if is_grouped(weight) else weight[token_ids]

    def lm_head(self, weight, h: jax.Array, rows: jax.Array, *, tied: bool) -> jax.Array:
        weight = _stored(weight)
        if is_grouped(weight):
            head = dequantize(weight.T if tied else weight, h.dtype)
            return jnp.dot(h, head, preferred_element_type=jnp.float32)
        return super().lm_head(weight, h, rows, tied=tied)


GROUPED = GroupedProducts()
