"""How the runner keeps the model's weights on its device, and the matrix products that read them.

Accelerators, and a CPU where the C++ matmul kernel cannot be built, keep the loaders' stacks and XLA's dots
(`models.llama.StackedProducts`). On CPU the four big matrices of each layer are kept as panels of 16 columns for
the kernel (jpaged/pallas/cpu/matmul.py), which reads a layer's matrix in place in the stack and computes only the
step's live rows; the LM head as panels too (scripts/bench_matmul.py times it against XLA's dots).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from jpaged.models.llama import STACKED, MatrixProducts
from jpaged.pallas.cpu import matmul as cpu_matmul

LAYER_MATRICES = ("w_qkv", "wo", "w_gate_up", "w_down")


@dataclass(frozen=True)
class PanelProducts:
    """The products of the CPU matmul kernel over params in the layout `layout` makes: each layer matrix's stack
    as panels [L, P, K, 16] under "panels", the LM head's under "lm_head_panels"; a tied embedding is then read
    from the LM head's panels, so the vocabulary matrix is held once. The small per-layer vectors stay under
    "layers". `widths` are the matrices' output sizes (panels round them up to 16)."""

    widths: tuple[tuple[str, int], ...]
    vocab_size: int

    @classmethod
    def for_params(cls, params: dict) -> PanelProducts:
        widths = tuple((name, params["layers"][name].shape[-1]) for name in LAYER_MATRICES)
        return cls(widths, params["embed"].shape[0])

    def layout(self, params: dict) -> dict:
        layers = dict(params["layers"])
        panels = {name: cpu_matmul.pack(layers.pop(name)) for name in LAYER_MATRICES}
        tied = "lm_head" not in params
        head = cpu_matmul.pack(params["embed"].T if tied else params["lm_head"])
        dropped = ("layers", "lm_head") + tied * ("embed",)
        kept = {key: value for key, value in params.items() if key not in dropped}
        return {**kept, "layers": layers, "panels": panels, "lm_head_panels": head}

    def embed(self, params: dict, token_ids: jax.Array) -> jax.Array:
        if "embed" in params:
            return params["embed"][token_ids]
        return cpu_matmul.columns(params["lm_head_panels"], token_ids)

    def layer(self, params, layer_params, name, layer, x, rows) -> jax.Array:
        width = dict(self.widths)[name]
        return cpu_matmul.matmul(x, params["panels"][name], width, layer=layer, rows=rows)

    def lm_head(self, params: dict, h: jax.Array, rows: jax.Array) -> jax.Array:
        return cpu_matmul.matmul(
            h, params["lm_head_panels"], self.vocab_size, rows=rows, out_dtype=jax.numpy.float32
        )


def choose_products(params: dict, layout: str = "auto") -> MatrixProducts:
    """The products for these params (arrays or ShapeDtypeStructs): `auto` takes the CPU kernel's panels where
    the backend is the CPU and the kernel builds and takes the dtype, else the stacks; `stacked` and `panels`
    force one (tests and benchmarks compare them)."""
    if layout == "auto":
        on_cpu = jax.default_backend() == "cpu"
        layout = "panels" if on_cpu and cpu_matmul.supports(params["final_norm"].dtype) else "stacked"
    if layout == "panels":
        return PanelProducts.for_params(params)
    if layout == "stacked":
        return STACKED
    raise ValueError(f"layout must be 'auto', 'stacked' or 'panels', got {layout!r}")


def weights_spec(params: dict) -> dict:
    """The params' tree with each leaf's shape and dtype only (what the compiled steps depend on)."""
    return jax.tree_util.tree_map(lambda leaf: jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype), params)


def check_same_leaves(current: dict, new: dict) -> None:
    """New weights must be the engine's leaf for leaf (same paths, shapes, dtypes), so every compiled step still
    takes them; raises ValueError naming the first leaf that differs."""
    flatten = jax.tree_util.tree_flatten_with_path
    ours = {jax.tree_util.keystr(path): leaf for path, leaf in flatten(current)[0]}
    theirs = {jax.tree_util.keystr(path): leaf for path, leaf in flatten(new)[0]}
    for path, leaf in ours.items():
        if path not in theirs:
            raise ValueError(f"params{path} is missing from the new weights")
        other = theirs[path]
        shape, dtype = np.shape(other), getattr(other, "dtype", None)
        if shape != np.shape(leaf) or dtype != leaf.dtype:
            raise ValueError(
                f"params{path} is {dtype}{list(shape)} in the new weights, the engine's is {leaf.dtype}"
                f"{list(np.shape(leaf))}: weights must keep every leaf's shape and dtype"
            )
    extra = next((path for path in theirs if path not in ours), None)
    if extra is not None:
        raise ValueError(f"params{extra} is not one of the engine's weights")
