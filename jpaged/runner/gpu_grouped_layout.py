"""Group-quantized matrices on NVIDIA GPUs: the layer matrices (and an untied LM head) of a quantized checkpoint, a
GGUF's blocks or a 4-bit HF format's, held as the Pallas kernel reads them (pallas/gpu_grouped_matmul.py: codes
widened in registers) instead of dequantised where used; what the kernel cannot take (a tied embedding, groups under
16 inputs) stays as GroupedProducts multiplies it."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jpaged.models.grouped import GroupedMatrix, GroupedProducts, LaidOutGroups, is_grouped
from jpaged.models.products import layer_matrices
from jpaged.pallas import gpu_grouped_matmul


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KernelGroupedMatrix(LaidOutGroups):
    """A GroupedMatrix (a stack of them) with its codes `pack`ed for the GPU kernel."""

    @classmethod
    def of(cls, matrix: GroupedMatrix) -> KernelGroupedMatrix:
        codes = gpu_grouped_matmul.pack(matrix.codes, bits=matrix.bits, group=matrix.group_size)
        return cls(codes, matrix.scale, matrix.bias, matrix.bits, matrix.dtype)


def kernel_reads(matrix: GroupedMatrix) -> bool:
    """Whether the GPU kernel multiplies by this matrix as stored: [K, N] (not transposed), N a multiple of 16,
    groups it can walk."""
    if matrix.transposed or matrix.bits not in gpu_grouped_matmul.CODE_BITS or matrix.shape[-1] % 16:
        return False
    try:
        gpu_grouped_matmul.k_step(matrix.group_size, matrix.bits)
    except ValueError:
        return False
    return True


def _held(leaf):
    return KernelGroupedMatrix.of(leaf) if is_grouped(leaf) and kernel_reads(leaf) else leaf


@dataclass(frozen=True)
class KernelGroupedProducts(GroupedProducts):
    """GroupedProducts with the kernel taking every matrix it reads; `interpret` runs it in Pallas' interpret mode
    (the tests, on CPU)."""

    interpret: bool = False

    def hold(self, params: dict) -> dict:
        laid_out = jax.tree_util.tree_map(lambda leaf: leaf, params, is_leaf=is_grouped)
        for parent, leaf in layer_matrices(laid_out["layers"]).values():
            node = laid_out["layers"][parent]
            node[leaf] = _held(node[leaf])
        if "lm_head" in laid_out:
            laid_out["lm_head"] = _held(laid_out["lm_head"])
        return super().hold(laid_out)  # the rest as GroupedProducts holds it

    def _product(self, weight: KernelGroupedMatrix, x: jax.Array, out_dtype=None) -> jax.Array:
        return gpu_grouped_matmul.matmul(
            x,
            *weight.arrays(),
            bits=weight.bits,
            out_dtype=out_dtype,
            interpret=self.interpret,
        )

    def layer(self, name, weight, x, layer, rows) -> jax.Array:
        if isinstance(weight, KernelGroupedMatrix):
            return self._product(weight, x)
        return super().layer(name, weight, x, layer, rows)

    def lm_head(self, weight, h: jax.Array, rows: jax.Array, *, tied: bool) -> jax.Array:
        if isinstance(weight, KernelGroupedMatrix):
            return self._product(weight, h, jnp.float32)
        return super().lm_head(weight, h, rows, tied=tied)


KERNEL_GROUPED = KernelGroupedProducts()
