"""How the runner keeps the model's weights on its device, and the matrix products that read them.

Accelerators, and a CPU where the C++ matmul kernel cannot be built, keep the loaders' stacks and XLA's dots
(`models.products.StackedProducts`). On CPU the four big matrices of each layer are kept as panels of 16 columns for
the kernel (jpaged/pallas/cpu/matmul.py), which reads a layer's matrix in place in the stack and computes only the
step's live rows; the LM head as panels too (scripts/bench_matmul.py times it against XLA's dots). Group-quantized
layer matrices (a GGUF's blocks kept, models/grouped.py) become GroupedPanels for the grouped kernel
(jpaged/pallas/cpu/grouped_matmul.py), or off the CPU are dequantised where they are used (GroupedProducts).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.config import QUANTIZATIONS
from jpaged.models.activations import act_and_mul
from jpaged.models.config import ModelConfig
from jpaged.models.experts import routed_experts
from jpaged.models.grouped import (
    GROUPED,
    GroupedMatrix,
    GroupedProducts,
    LaidOutGroups,
    dequantize,
    embedding_rows,
    is_grouped,
)
from jpaged.models.llama import params_dtype
from jpaged.models.products import (
    EXPERT_MATRICES,
    LAYER_MATRICES,
    STACKED,
    MatrixProducts,
    StackedProducts,
    is_whole_leaf,
    layer_matrices,
)
from jpaged.models.quantized import QuantizedMatrix, QuantizedProducts, quantize
from jpaged.pallas.cpu import expert_matmul, grouped_matmul, int8_matmul
from jpaged.pallas.cpu import library as cpu_kernels
from jpaged.pallas.cpu import matmul as cpu_matmul
from jpaged.runner.gpu_grouped_layout import KERNEL_GROUPED

logger = logging.getLogger(__name__)

CPU_AUTO_DTYPE_ENV = "JPAGED_CPU_AUTO_DTYPE"


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class GroupedPanels(LaidOutGroups):
    """A stack of GroupedMatrix as the grouped kernel reads it (grouped_matmul.pack's panels)."""

    @classmethod
    def of(cls, matrix: GroupedMatrix, gated: bool = False) -> GroupedPanels:
        """The panels of a matrix [K, N] (not transposed)."""
        if matrix.transposed:
            raise ValueError("panels are made of a GroupedMatrix as stored, [K, N]")
        panels = grouped_matmul.pack(matrix.codes, matrix.scale, matrix.bias, bits=matrix.bits, gated=gated)
        return cls(*panels, matrix.bits, matrix.dtype)

    def columns(self, ids: jax.Array) -> jax.Array:
        """w[:, ids].T [len(ids), K] in the dtype it stands for (a tied embedding's rows from the LM head's),
        dequantised as every GroupedMatrix is."""
        codes, scale, bias = grouped_matmul.columns(self.arrays(), ids, bits=self.bits)
        rows = GroupedMatrix(codes.T, scale.T, bias.T, transposed=True, dtype=self.dtype)
        return dequantize(rows)


@dataclass(frozen=True)
class PanelProducts:
    """The products of the CPU matmul kernel over params in the layout `layout` makes: the same tree, with each
    layer matrix's stack as panels [L, P, K, 16] (handed to the kernel whole, with the layer's index) and the LM
    head as panels; a tied embedding is then read from the LM head's panels, so the vocabulary matrix is held
    once. `widths` are the matrices' output sizes (panels round them up to 16). Where gate and up are each a
    multiple of 16 wide (`gated_form`), gate_up packs for the kernel's gated form, which computes the MLP's
    activation on its sums."""

    widths: tuple[tuple[str, int], ...]
    vocab_size: int
    tied: bool
    gated_form: bool = False
    expert_widths: tuple[int, int] = (0, 0)  # a mixture of experts' gate_up and down output sizes (2F, D)
    experts_gated_form: bool = False  # its gate|up packed for the gated form
    whole_matrices: tuple[str, ...] = (*LAYER_MATRICES, *EXPERT_MATRICES)
    fused_groups: int = 1

    @classmethod
    def for_params(cls, params: dict, activation: str = "silu") -> PanelProducts:
        """The panels of these params; the kernel's gated form computes SiLU only, so another `activation`
        (Gemma's) takes the unfused product."""
        matrices = layer_matrices(params["layers"])
        widths = tuple((name, _at(params["layers"], path).shape[-1]) for name, path in matrices.items())
        gated_form = (
            "gate_up" in matrices and activation == "silu" and cpu_matmul.gated_packs(dict(widths)["gate_up"])
        )
        mlp, vocab_size = params["layers"]["mlp"], params["embed"]["weight"].shape[0]
        if "experts_gate_up" not in mlp:
            return cls(widths, vocab_size, "lm_head" not in params, gated_form)
        expert_widths = (mlp["experts_gate_up"].shape[-1], mlp["experts_down"].shape[-1])
        experts_gated = activation == "silu" and cpu_matmul.gated_packs(expert_widths[0])
        return cls(widths, vocab_size, "lm_head" not in params, gated_form, expert_widths, experts_gated)

    def layout(self, params: dict) -> dict:
        laid_out = jax.tree_util.tree_map(lambda leaf: leaf, params)  # a copy of the dicts, not of the arrays
        for name, path in layer_matrices(params["layers"]).items():
            *parents, leaf = path
            node = _at(laid_out["layers"], parents)
            node[leaf] = self.layer_panels(node[leaf], gated=name == "gate_up" and self.gated_form)
        mlp = laid_out["layers"]["mlp"]
        if "experts_gate_up" in mlp:  # [L, E, K, N] -> [L, E, P, K, 16]
            mlp["experts_gate_up"] = _panels(mlp["experts_gate_up"], gated=self.experts_gated_form)
            mlp["experts_down"] = _panels(mlp["experts_down"])
        if self.tied:
            laid_out["embed"]["weight"] = _panels(params["embed"]["weight"].T)
        else:
            laid_out["lm_head"] = _panels(params["lm_head"])
        return laid_out

    def layer_panels(self, matrix, gated: bool):
        """A layer matrix's stack as `layer` reads it."""
        return _panels(matrix, gated)

    def embed(self, weight, token_ids: jax.Array) -> jax.Array:
        if isinstance(weight, GroupedPanels):
            return weight.columns(token_ids)
        if self.tied:
            return cpu_matmul.columns(weight, token_ids)
        return embedding_rows(weight, token_ids) if is_grouped(weight) else weight[token_ids]

    def layer(self, name, weight, x, layer, rows) -> jax.Array:
        if isinstance(weight, GroupedPanels):
            return grouped_matmul.matmul(x, weight.arrays(), dict(self.widths)[name], layer=layer, rows=rows)
        return cpu_matmul.matmul(x, weight, dict(self.widths)[name], layer=layer, rows=rows)

    def gated(self, weight, x, layer, rows, sizes, activation) -> jax.Array:
        if self.gated_form and isinstance(weight, GroupedPanels):
            return grouped_matmul.gated_matmul(x, weight.arrays(), sizes[0], layer=layer, rows=rows)
        if self.gated_form:
            return cpu_matmul.gated_matmul(x, weight, sizes[0], layer=layer, rows=rows)
        return act_and_mul(
            self.layer("gate_up", weight, x, layer, rows), sizes, self.fused_groups, activation
        )

    def experts_gated(self, weight, x, group_sizes, layer, activation, bias=None) -> jax.Array:
        width = self.expert_widths[0]
        if self.experts_gated_form and bias is None:
            return expert_matmul.gated_matmul(x, weight, group_sizes, width // 2, layer=layer)
        h = expert_matmul.matmul(x, weight, group_sizes, width, layer=layer)
        h = h if bias is None else h + bias
        return act_and_mul(h, (width // 2, width // 2), self.fused_groups, activation)

    def experts_down(self, weight, x, group_sizes, layer) -> jax.Array:
        return expert_matmul.matmul(x, weight, group_sizes, self.expert_widths[1], layer=layer)

    def mixture(self, x, weights, experts, gate_up, down, layer, live, activation, biases=None) -> jax.Array:
        return routed_experts(
            x,
            weights,
            experts,
            gate_up.shape[1],  # the panels [L, E, P, K, 16]
            live=live,
            gated=lambda rows, sizes, bias: self.experts_gated(gate_up, rows, sizes, layer, activation, bias),
            down=lambda h, sizes: self.experts_down(down, h, sizes, layer),
            biases=biases,
        )

    def lm_head(self, weight, h: jax.Array, rows: jax.Array, *, tied: bool) -> jax.Array:
        if isinstance(weight, GroupedPanels):
            return grouped_matmul.matmul(
                h, weight.arrays(), self.vocab_size, rows=rows, out_dtype=jnp.float32
            )
        return cpu_matmul.matmul(h, weight, self.vocab_size, rows=rows, out_dtype=jnp.float32)


@dataclass(frozen=True)
class Int8PanelProducts(PanelProducts):
    """`--quantization int8` on the CPU: each layer matrix quantized as QuantizedProducts quantizes it (int8, a
    scale a column), as the int8 kernel's panels (pallas/cpu/int8_matmul.py), which quantises the activations per
    token, sums exactly and scales back: the products equal QuantizedProducts' XLA int8 dots to the bit. The
    embedding and LM head as PanelProducts holds them; the gated form where PanelProducts takes it."""

    def layer_panels(self, matrix, gated: bool) -> QuantizedMatrix:
        quantized = matrix if isinstance(matrix, QuantizedMatrix) else quantize(matrix, "int8")
        return QuantizedMatrix(*int8_matmul.pack(quantized.values, quantized.scale, gated=gated))

    def layer(self, name, weight, x, layer, rows) -> jax.Array:
        panels = (weight.values, weight.scale)
        return int8_matmul.matmul(x, panels, dict(self.widths)[name], layer=layer, rows=rows)

    def gated(self, weight, x, layer, rows, sizes, activation) -> jax.Array:
        if self.gated_form:
            panels = (weight.values, weight.scale)
            return int8_matmul.gated_matmul(x, panels, sizes[0], layer=layer, rows=rows)
        return super().gated(weight, x, layer, rows, sizes, activation)


def _panels(matrix, gated: bool = False):
    """A matrix [K, N] as its kernel's panels: GroupedPanels of a GroupedMatrix, else the dense kernel's."""
    if is_grouped(matrix):
        return GroupedPanels.of(matrix, gated)
    return cpu_matmul.kernel_panels(matrix, gated=gated)


def _at(tree: dict, path) -> dict:
    for key in path:
        tree = tree[key]
    return tree


def choose_products(
    params: dict, layout: str = "auto", *, activation: str, quantization: str | None = None
) -> MatrixProducts:
    """The products for these params (arrays or ShapeDtypeStructs) of a model whose MLP takes `activation`
    (ModelConfig.hidden_activation): `auto` takes the CPU kernel's panels where the backend is the CPU and the
    kernel builds and takes the dtype, else the stacks; `stacked` and `panels` force one (tests and benchmarks
    compare them). With `quantization` (EngineConfig's int8 or fp8, or a checkpoint's own W8A8 matrices), the layer
    matrices are held quantized (models.quantized), multiplied by XLA's native int8/fp8 dots, or on the CPU (int8) by
    the int8 kernel. Group-quantized matrices go to the grouped kernel with the CPU's panels, to the Pallas kernel
    on a GPU (gpu_grouped_layout.py), else are dequantised where used (GroupedProducts)."""
    on_cpu = jax.default_backend() == "cpu"
    matrices = jax.tree_util.tree_leaves(params, is_leaf=is_whole_leaf)
    quantization = _checkpoint_scheme(matrices) or quantization
    if quantization in QUANTIZATIONS:
        if (
            quantization == "int8"
            and layout == "auto"
            and on_cpu
            and cpu_matmul.supports(params_dtype(params))
            # the kernel quantises activations per token: a checkpoint's static input scales take XLA's dots
            and not any(isinstance(m, QuantizedMatrix) and m.input_scale is not None for m in matrices)
        ):
            return Int8PanelProducts.for_params(params, activation)
        return QuantizedProducts(scheme=quantization)
    grouped = [matrix for matrix in matrices if is_grouped(matrix)]
    if layout == "auto":
        kernel_reads = all(grouped_matmul.reads(matrix) for matrix in grouped)
        layout = (
            "panels" if on_cpu and cpu_matmul.supports(params_dtype(params)) and kernel_reads else "stacked"
        )
    if layout == "panels":
        return PanelProducts.for_params(params, activation)
    if layout == "stacked":
        if grouped:
            return KERNEL_GROUPED if jax.default_backend() == "gpu" else GROUPED
        return STACKED
    raise ValueError(f"layout must be 'auto', 'stacked' or 'panels', got {layout!r}")


def tensor_parallel_products(
    params: dict, config: ModelConfig, shards: int, quantization: str | None = None
) -> StackedProducts:
    """The products over `shards` devices: XLA's dots, which it partitions (the kernels see whole matrices), on
    fused columns grouped per shard; quantized matrices held as stored (W8A8 ones, or all of them quantized for
    `quantization`, multiplied by the native dots; grouped ones dequantised where used) and split as their float
    matrices (tensor_parallel.param_shardings)."""
    matrices = jax.tree_util.tree_leaves(params, is_leaf=is_whole_leaf)
    quantization = _checkpoint_scheme(matrices) or quantization
    if quantization in QUANTIZATIONS:
        return QuantizedProducts(config, shards, scheme=quantization)
    if any(is_grouped(matrix) for matrix in matrices):
        return GroupedProducts(config, shards)
    return StackedProducts(config, shards)


def _checkpoint_scheme(matrices: list) -> str | None:
    """The W8A8 scheme a checkpoint's own QuantizedMatrix leaves are stored in, if it has any."""
    schemes = {matrix.scheme for matrix in matrices if isinstance(matrix, QuantizedMatrix)}
    if len(schemes) > 1:
        raise ValueError(f"a checkpoint mixing W8A8 schemes {sorted(schemes)} is not supported")
    return schemes.pop() if schemes else None


def held_weight_bytes(params: dict, activation: str, quantization: str | None) -> dict[str, int]:
    """Bytes of the weights as the runner will hold them (the layout `choose_products` picks: panels, quantized
    matrices), by dtype; computed abstractly, nothing is laid out."""
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    products = choose_products(abstract, activation=activation, quantization=quantization)
    held: dict[str, int] = {}
    for leaf in jax.tree_util.tree_leaves(jax.eval_shape(products.layout, abstract)):
        held[str(leaf.dtype)] = held.get(str(leaf.dtype), 0) + leaf.size * leaf.dtype.itemsize
    return held


def cpu_auto_dtype() -> np.dtype:
    """bfloat16 where the CPU matmul kernel multiplies bfloat16 with the CPU's own dot-product instructions,
    float32 where it would widen every weight to float32 first (slower at batch sizes past a few rows:
    scripts/KERNELS.md). Decided by the CPU's flags (what a `-march=native` build of the kernels multiplies
    with), not timed at start-up and not waiting for the kernels' build, so one command on one machine always runs
    one dtype (and gives the same greedy output). `JPAGED_CPU_AUTO_DTYPE` pins it (a fleet of mixed CPUs that must
    answer alike; the tests, which compare against float32 references, pin float32). Logs which and why."""
    pinned = os.environ.get(CPU_AUTO_DTYPE_ENV)
    if pinned:
        if pinned not in ("float32", "bfloat16"):
            raise ValueError(f"{CPU_AUTO_DTYPE_ENV} must be float32 or bfloat16, got {pinned!r}")
        logger.info("dtype auto: %s, as %s says", pinned, CPU_AUTO_DTYPE_ENV)
        return np.dtype(jax.numpy.dtype(pinned))
    instructions = cpu_kernels.bfloat16_dot_products()
    if instructions:
        logger.info("dtype auto: bfloat16, the CPU multiplies bfloat16 itself (%s)", instructions)
        return np.dtype(jax.numpy.bfloat16)
    logger.info(
        "dtype auto: float32, this CPU has no bfloat16 dot-product instructions (or no C++ compiler to build "
        "its kernels; --dtype bfloat16 halves the weights' bytes)"
    )
    return np.dtype(np.float32)
