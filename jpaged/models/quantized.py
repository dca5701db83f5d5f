"""Layer matrices held quantized, as vLLM's online `--quantization int8` and `fp8` (W8A8, dynamic): each matrix
int8 or float8 (e4m3) with a float32 scale per output column, each token's activations quantised on the fly with a
scale of its own, the product accumulated in int32 (int8) or float32 (fp8) and scaled back. A calibrated
checkpoint's matrix may carry a static activation scale instead (`input_scale`, one a matrix): every token is then
quantised by that one scale, clipped to the format's range, as vLLM applies it.

A quantized matrix is a `QuantizedMatrix` pytree (values, scale[, input_scale]) in the place of the float stack in
the model's state: the layer scan slices each like any leaf and the modules are unchanged; `QuantizedProducts` is
the MatrixProducts that reads it. The embedding and the LM head stay in the model's dtype, as vLLM keeps them.

`QuantizedProducts(reference=True)` widens the same quantised operands to float32 and multiplies them there (the
row and column scales applied to the sums, where they commute with the dot): the XLA dequantise-then-dot form the
native dots (and any kernel for a format) are held to. The scales are applied to the sums rather than to the
operands, and int8 sums are taken in runs that keep them exact (below 2^24) as the int32 ones are: a rounding
difference in one layer's sums would otherwise move the next layer's activation quantisation by a step, which
thirty layers of the embedded model amplify to percents of its logits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jpaged.config import QUANTIZATIONS
from jpaged.models.products import StackedProducts, WholeLeaf, layer_matrices

# The largest magnitude each stores symmetrically (e4m3's finite maximum): what a fitted scale maps onto.
_LARGEST = {"int8": 127.0, "fp8": 448.0}
# What each stores: where a static scale's quotients are clipped, as vLLM clips them.
_RANGE = {"int8": (-128.0, 127.0), "fp8": (-448.0, 448.0)}
_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedMatrix(WholeLeaf):
    """A matrix [..., K, N] as `values` (int8 or float8_e4m3fn) times `scale` [..., 1, N] (float32). A checkpoint's
    [out, in] matrix comes with a scale a row, [..., N, 1], until `.T` puts it the way the products read it.
    `input_scale` [..., 1, 1] (float32) is a calibrated checkpoint's static activation scale; None quantises the
    activations per token."""

    values: jax.Array
    scale: jax.Array
    input_scale: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def T(self) -> QuantizedMatrix:  # noqa: N802 (numpy's name)
        return QuantizedMatrix(self.values.swapaxes(-1, -2), self.scale.swapaxes(-1, -2), self.input_scale)

    @property
    def scheme(self) -> str:
        """The W8A8 scheme its values are stored in."""
        return "int8" if self.values.dtype == jnp.int8 else "fp8"


def _quantized(x: jax.Array, amax: jax.Array, scheme: str) -> tuple[jax.Array, jax.Array]:
    """x stored as `scheme` with the scale that maps `amax` (broadcasting over x) onto its largest value."""
    scale = jnp.where(amax > 0, amax / _LARGEST[scheme], 1.0)
    return _scaled_by(x, scale, scheme), scale


def _scaled_by(x: jax.Array, scale: jax.Array, scheme: str) -> jax.Array:
    """x / scale stored as `scheme`: rounded (int8) and clipped to what the format stores (a scale fitted to x
    never reaches int8's -128, a static one may)."""
    scaled = x / scale
    if scheme == "int8":
        scaled = jnp.round(scaled)
    return jnp.clip(scaled, *_RANGE[scheme]).astype(_DTYPES[scheme])


def quantize(weight: jax.Array, scheme: str) -> QuantizedMatrix:
    """A [..., K, N] matrix with one scale per output column (its largest magnitude onto the format's)."""
    w = jnp.asarray(weight, jnp.float32)
    values, scale = _quantized(w, jnp.max(jnp.abs(w), axis=-2, keepdims=True), scheme)
    return QuantizedMatrix(values, scale)


def quantize_rows(x: jax.Array, scheme: str) -> tuple[jax.Array, jax.Array]:
    """Activations [T, K] with one scale per token (row): (values, scale [T, 1])."""
    x32 = x.astype(jnp.float32)
    return _quantized(x32, jnp.max(jnp.abs(x32), axis=-1, keepdims=True), scheme)


def quantize_static(x: jax.Array, input_scale: jax.Array, scheme: str) -> jax.Array:
    """Activations [T, K] by a checkpoint's static scale [1, 1]: x / input_scale, clipped to the format's range."""
    return _scaled_by(x.astype(jnp.float32), input_scale, scheme)


def _float32_sums(xq: jax.Array, values: jax.Array, scheme: str) -> jax.Array:
    """xq @ values with both widened to float32. For int8, over runs of K short enough that the float32 sums of
    the integer products stay exact (below 2^24), each run's sum then added: for K up to two runs this is the
    exact sum rounded once, as the int32 sums converted to float32 are. (Products are at most 128^2: a checkpoint's
    int8 weights and static-scaled activations reach -128.)"""
    xs, ws = xq.astype(jnp.float32), values.astype(jnp.float32)
    run = 2**24 // 128**2 if scheme == "int8" else xs.shape[-1]
    parts = [xs[:, k : k + run] @ ws[k : k + run] for k in range(0, xs.shape[-1], run)]
    return functools.reduce(jnp.add, parts)


def quantized_matmul(
    x: jax.Array, weight: QuantizedMatrix, scheme: str, reference: bool = False
) -> jax.Array:
    """x [T, K] @ a quantized [K, N], W8A8 with x quantised per token, or by the matrix's static input scale where
    it has one; in x's dtype."""
    if weight.input_scale is None:
        xq, x_scale = quantize_rows(x, scheme)
    else:
        xq, x_scale = quantize_static(x, weight.input_scale, scheme), weight.input_scale
    if reference:
        sums = _float32_sums(xq, weight.values, scheme)
    else:
        accumulate = jnp.int32 if scheme == "int8" else jnp.float32
        sums = jax.lax.dot(xq, weight.values, preferred_element_type=accumulate)
    return rescaled(sums, x_scale, weight.scale, x.dtype)


def rescaled(sums: jax.Array, x_scale: jax.Array, w_scale: jax.Array, dtype) -> jax.Array:
    """A W8A8 product's sums [T, N] times the tokens' scales [T, 1] and the columns' [1, N], in `dtype` (how every
    form scales them, so that equal sums give equal bits)."""
    return (sums.astype(jnp.float32) * x_scale * w_scale).astype(dtype)


@dataclass(frozen=True)
class QuantizedProducts(StackedProducts):
    """XLA's dots with the layer matrices quantized to `scheme` (the layout does it, once, at load), the embedding
    and LM head as StackedProducts multiplies them."""

    scheme: str = "int8"
    reference: bool = False  # dequantise-then-dot in float32 (the tests' reference) instead of the native dot

    def __post_init__(self) -> None:
        if self.scheme not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.scheme!r}")

    def hold(self, params: dict) -> dict:
        laid_out = jax.tree_util.tree_map(lambda leaf: leaf, params)  # new dicts, same arrays
        for parent, leaf in layer_matrices(laid_out["layers"]).values():
            node = laid_out["layers"][parent]
            if not isinstance(node[leaf], QuantizedMatrix):  # a checkpoint's own are kept
                node[leaf] = quantize(node[leaf], self.scheme)
        return laid_out

    def layer(self, name, weight, x, layer, rows) -> jax.Array:
        return quantized_matmul(x, weight, self.scheme, self.reference)
