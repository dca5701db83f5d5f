"""LoRA on the CPU through the C++ matmul kernel (pallas/cpu/matmul.py): XLA's CPU dots run the deltas' small
products at a tenth of the kernel's speed, so the stacks are the kernel's panels and each delta is two kernel
products over every slot at once (models/lora.py's dense form): x A_all [T, S x Wp], each token keeping its own
slot's columns, times B_all [S x Wp, out]. A step no token of which has an adapter skips both (a branch: CPU only).
Measured against the alternatives (scripts/KERNELS.md): the C++ experts kernel, one slot an expert (punica's SGMV,
no slot's work wasted), and B kept per fused part (none of the block-diagonal zeros) were both slower, their extra
calls, sorts and concatenations costing more than the work they saved at these sizes.

  A  [L, S x Wp / 16, in, 16]   panels of [in, S x Wp]: slot s's W columns from column s x Wp, zero to Wp
  B  [L, ceil(out / 16), S x Wp, 16]   panels of [S x Wp, out]: slot s's W rows from row s x Wp
Wp is W rounded up to the panel width, 16, so a slot's columns of A are whole panels. Whole stacks are handed to the
kernel with the layer's index, as the layer matrices are (no per-layer slice is copied).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

from jpaged.pallas.cpu import matmul as cpu_matmul
from jpaged.rounding import cdiv

PANEL = 16


@dataclass(frozen=True)
class PanelLoRA:
    num_slots: int
    widths: tuple[tuple[str, int, int], ...]  # (matrix, its W, its out) of each matrix the stacks hold
    whole_stacks: ClassVar[bool] = True  # handed whole, with the layer's index

    def _padded(self, width: int) -> int:
        return cdiv(width, PANEL) * PANEL

    def shapes(self, fan_in: int, width: int, fan_out: int, layers: int, slots: int) -> tuple[tuple, tuple]:
        columns = slots * self._padded(width)
        return (layers, columns // PANEL, fan_in, PANEL), (layers, cdiv(fan_out, PANEL), columns, PANEL)

    def write(self, stacks: dict, row: jax.Array, adapter: dict) -> dict:
        """Stack row `row` (slot row + 1) set to one adapter's arrays (name -> {"a": [L, in, W], "b": [L, W, out]})."""
        written = {}
        for name, pair in adapter.items():
            stack = stacks[name]
            padded = self._padded(pair["a"].shape[-1])
            extra = padded - pair["a"].shape[-1]
            a = cpu_matmul.kernel_panels(
                jnp.pad(pair["a"], ((0, 0), (0, 0), (0, extra))).astype(stack["a"].dtype)
            )
            b = cpu_matmul.kernel_panels(
                jnp.pad(pair["b"], ((0, 0), (0, extra), (0, 0))).astype(stack["b"].dtype)
            )
            written[name] = {
                "a": jax.lax.dynamic_update_slice(stack["a"], a, (0, row * (padded // PANEL), 0, 0)),
                "b": jax.lax.dynamic_update_slice(stack["b"], b, (0, 0, row * padded, 0)),
            }
        return written

    def delta(self, name: str, x: jax.Array, stacks: dict, slots: jax.Array, layer, rows) -> jax.Array:
        width, fan_out = next((w, out) for n, w, out in self.widths if n == name)
        padded = self._padded(width)

        def products() -> jax.Array:
            xa = cpu_matmul.matmul(x, stacks["a"], self.num_slots * padded, layer=layer, rows=rows)
            own = slots[:, None] == jnp.arange(1, self.num_slots + 1)[None, :]  # [T, S]
            xa = jnp.where(jnp.repeat(own, padded, axis=1), xa, 0)
            return cpu_matmul.matmul(xa, stacks["b"], fan_out, layer=layer, rows=rows)

        return jax.lax.cond(jnp.any(slots > 0), products, lambda: jnp.zeros((x.shape[0], fan_out), x.dtype))
