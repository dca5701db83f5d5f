"""PEFT LoRA adapters as the engine holds them: for each layer matrix the model has (products.LAYER_MATRICES),
A [L, in, width] and B [L, width, out] in float32, width = parts * max_rank, so that x @ A[l] @ B[l] is the
adapter's delta of layer l's matrix in the state's plain fused column order (fused_columns.fused_sizes).

Every adapter has the same shapes whatever its rank and targets, so the engine can stack adapters into fixed
device slots. Part p of a fused matrix (q, k, v of qkv; gate, up of gate_up) owns A's columns and B's rows
[p * max_rank, p * max_rank + r), B block-diagonal by part: separate q/k/v modules (each its own lora_A) and one
fused module (Phi-3's qkv_proj, whose lora_A every part shares) fit alike. PEFT's scale is folded into B; what
the adapter does not target stays zero."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jpaged.models.config import ModelConfig
from jpaged.models.fused_columns import fused_sizes
from jpaged.models.params import hf_recipes
from jpaged.models.products import LAYER_MATRICES

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # before the base model's module names in PEFT's tensor names
# adapter_config.json fields that make an adapter compute other than x @ A @ B on the layer matrices (DoRA, a
# bias on B, whole trained modules, replicated layers, trained tokens, activated LoRA, QA-LoRA's pooled input,
# block-diagonal factors, KaSA's singular values, Arrow's routing, LoRA on raw parameters): refused when set.
UNSUPPORTED_FIELDS = (
    "use_dora",
    "lora_bias",
    "modules_to_save",
    "layer_replication",
    "trainable_token_indices",
    "alora_invocation_tokens",
    "use_qalora",
    "use_bdlora",
    "kasa_config",
    "arrow_config",
    "target_parameters",
)
# safetensors' dtype names for the float types adapters are saved in (numpy itself has no bfloat16).
FLOAT_DTYPES = frozenset(np.dtype(t) for t in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16))
_LORA_WEIGHT = re.compile(r"lora_(?P<side>[AB])(\.default)?\.weight")


@dataclass(frozen=True)
class LoRAAdapter:
    config: dict  # adapter_config.json as read
    rank: int  # the largest rank among its modules
    weights: dict[str, dict[str, np.ndarray]]  # matrix -> {"a": [L, in, width], "b": [L, width, out]} float32


@dataclass(frozen=True)
class _Target:
    """The layer matrix a checkpoint module (one recipe name, "{i}" its layer) is part of, and which parts."""

    matrix: str
    parts: tuple[int, ...]
    pattern: re.Pattern
    short_name: str  # the module's own name, as target_modules names it (q_proj, qkv_proj...)


def lora_shapes(config: ModelConfig, max_rank: int) -> dict[str, tuple[int, int, int]]:
    """(in, width, out) of each matrix the model has: A is [L, in, width] and B [L, width, out], width being
    parts * max_rank (3 parts for qkv, 2 for gate_up, 1 for o and down)."""
    return {
        name: (fan_in, len(sizes) * max_rank, sum(sizes))
        for name, (fan_in, sizes) in _matrices(config).items()
    }


def read_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """The adapter PEFT's save_pretrained wrote in directory `path` (adapter_config.json and
    adapter_model.safetensors)."""
    path = Path(path)
    config_path, weights_path = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    for needed in (config_path, weights_path):
        if not needed.is_file():
            raise FileNotFoundError(f"LoRA adapter {path}: no {needed.name} at {needed}")
    try:
        adapter_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"cannot read LoRA adapter config {config_path}: {err}") from err
    return adapter_from_tensors(_read_safetensors(weights_path), adapter_config, config, max_rank)


def adapter_from_tensors(
    tensors: Mapping[str, Any], adapter_config: Mapping[str, Any], config: ModelConfig, max_rank: int
) -> LoRAAdapter:
    """The adapter from PEFT-named tensors (numpy, torch or jax arrays; as saved, or with ".default" as a model's
    in-memory state names them) and its adapter_config."""
    check_adapter_config(adapter_config)
    matrices, targets = _matrices(config), _targets(config)
    weights = {
        name: {
            "a": np.zeros((config.num_layers, fan_in, width), np.float32),
            "b": np.zeros((config.num_layers, width, fan_out), np.float32),
        }
        for name, (fan_in, width, fan_out) in lora_shapes(config, max_rank).items()
    }
    rank = 0
    for module, (a, b) in _lora_pairs(tensors, targets).items():
        target, layer = _locate(module, targets, config)
        fan_in, sizes = matrices[target.matrix]
        r = a.shape[0]
        out = sum(sizes[p] for p in target.parts)
        if a.shape != (r, fan_in) or b.shape != (out, r):
            raise ValueError(
                f"LoRA module {module!r} does not fit the model's {target.matrix} matrix: expected lora_A "
                f"[r, {fan_in}] and lora_B [{out}, r], got {list(a.shape)} and {list(b.shape)}"
            )
        if r > max_rank:
            raise ValueError(f"LoRA module {module!r} has rank {r}, which exceeds max_lora_rank {max_rank}")
        scale = _scale(module, r, adapter_config)
        offsets = np.cumsum((0, *sizes))
        a_out, b_out = weights[target.matrix]["a"], weights[target.matrix]["b"]
        row = 0
        for p in target.parts:
            block = slice(p * max_rank, p * max_rank + r)
            a_out[layer, :, block] = a.T
            b_out[layer, block, offsets[p] : offsets[p + 1]] = scale * b[row : row + sizes[p]].T
            row += sizes[p]
        rank = max(rank, r)
    if rank == 0:
        raise ValueError("the LoRA adapter holds no lora_A / lora_B weights")
    return LoRAAdapter(dict(adapter_config), rank, weights)


def is_layout(weights: Mapping[str, Any]) -> bool:
    """Whether `weights` is in the engine's own layout (matrix name -> {"a", "b"}) rather than PEFT-named."""
    return bool(weights) and all(
        name in LAYER_MATRICES and isinstance(pair, Mapping) for name, pair in weights.items()
    )


def adapter_from_layout(
    weights: Mapping[str, Mapping[str, Any]], config: ModelConfig, max_rank: int
) -> LoRAAdapter:
    """An adapter given in the engine's own layout (name -> {"a": [L, in, W], "b": [L, W, out]}, lora_shapes; the
    scale folded into B): what a JAX trainer of jpaged's own model holds (scripts/rl_rollout_demo.py --lora). Any
    [in, W] x [W, out] pair is a delta of rank at most W; matrices left out are zero."""
    shapes = lora_shapes(config, max_rank)
    unknown = sorted(set(weights) - set(shapes))
    if unknown:
        raise ValueError(f"LoRA weights name {unknown}: this model's matrices are {sorted(shapes)}")
    out = {}
    for name, (fan_in, width, fan_out) in shapes.items():
        expected = {"a": (config.num_layers, fan_in, width), "b": (config.num_layers, width, fan_out)}
        pair = weights.get(name)
        out[name] = {part: np.zeros(shape, np.float32) for part, shape in expected.items()}
        for part, shape in expected.items() if pair is not None else ():
            if part not in pair or np.shape(pair[part]) != shape:
                got = np.shape(pair[part]) if part in pair else "nothing"
                raise ValueError(f"LoRA weights {name}.{part}: expected shape {shape}, got {got}")
            out[name][part] = _float32(pair[part])
    return LoRAAdapter({}, max_rank, out)


def check_adapter_config(adapter_config: Mapping[str, Any]) -> None:
    """Refuse, naming the field, adapters that are not plain LoRA (x @ A @ B on the layer matrices)."""
    peft_type = adapter_config.get("peft_type")
    if peft_type != "LORA":
        raise ValueError(f"peft_type {peft_type!r} is not supported: jpaged reads LORA adapters")
    bias = adapter_config.get("bias", "none")
    if bias != "none":
        raise ValueError(f"bias {bias!r} is not supported: jpaged reads LoRA adapters with bias 'none'")
    for field in UNSUPPORTED_FIELDS:
        if adapter_config.get(field):
            raise ValueError(
                f"{field} {adapter_config[field]!r} is not supported: jpaged applies plain LoRA (x @ A @ B)"
            )


def _matrices(config: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each layer matrix the model has, by its LAYER_MATRICES name: its input width and its column parts."""
    d, f = config.hidden_size, config.intermediate_size
    fused = fused_sizes(config)
    every = {
        "qkv": (d, fused["qkv"]),
        "o": (config.num_heads * config.head_dim, (d,)),
        "gate_up": (d, fused["gate_up"]),
        "down": (f, (d,)),
    }
    recipes = hf_recipes(config)
    return {name: every[name] for name, path in LAYER_MATRICES.items() if _recipe_path(path) in recipes}


def _targets(config: ModelConfig) -> list[_Target]:
    """The checkpoint modules LoRA may target, from the family's recipes: one per part of a fused matrix stored
    as parts (q_proj, k_proj, v_proj), or one covering every part where it is stored fused (Phi-3's qkv_proj)."""
    recipes = hf_recipes(config)
    targets = []
    for name, (_, sizes) in _matrices(config).items():
        names = recipes[_recipe_path(LAYER_MATRICES[name])].names
        parts = [(p,) for p in range(len(sizes))] if len(names) == len(sizes) else [tuple(range(len(sizes)))]
        for tensor, covered in zip(names, parts, strict=True):
            module = tensor.removesuffix(".weight")
            pattern = re.compile(r"(\d+)".join(re.escape(piece) for piece in module.split("{i}")))
            targets.append(_Target(name, covered, pattern, module.rsplit(".", 1)[-1]))
    return targets


def _recipe_path(path: tuple[str, str]) -> str:
    return "/".join(("layers", *path))


def _locate(module: str, targets: list[_Target], config: ModelConfig) -> tuple[_Target, int]:
    """The target a PEFT module name (without PEFT's prefix) is, and its layer."""
    for target in targets:
        match = target.pattern.fullmatch(module)
        if match:
            layer = int(match.group(1))
            if layer >= config.num_layers:
                raise ValueError(
                    f"LoRA module {module!r} is in layer {layer}; the model has {config.num_layers} layers"
                )
            return target, layer
    raise ValueError(f"LoRA on module {module!r} is not supported; {_supported(targets)}")


def _supported(targets: list[_Target]) -> str:
    return "jpaged supports LoRA on " + ", ".join(dict.fromkeys(target.short_name for target in targets))


def _lora_pairs(
    tensors: Mapping[str, Any], targets: list[_Target]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """module name -> (lora_A [r, in], lora_B [out, r]) as float32, from PEFT's tensor names."""
    sides: dict[str, dict[str, np.ndarray]] = {}
    for name, tensor in tensors.items():
        module, _, rest = name.removeprefix(PEFT_PREFIX).partition(".lora_")
        match = _LORA_WEIGHT.fullmatch("lora_" + rest) if rest else None
        if match is None:
            raise ValueError(
                f"adapter tensor {name!r} is not supported: jpaged reads lora_A and lora_B weights; "
                f"{_supported(targets)}"
            )
        side = match["side"]
        if side in sides.setdefault(module, {}):
            raise ValueError(f"LoRA module {module!r} has more than one lora_{side}")
        sides[module][side] = _float32(tensor)
    for module, pair in sides.items():
        for side, other in (("A", "B"), ("B", "A")):
            if side in pair and other not in pair:
                raise ValueError(f"LoRA module {module!r} has a lora_{side} without its lora_{other}")
    return {module: (pair["A"], pair["B"]) for module, pair in sides.items()}


def _scale(module: str, rank: int, adapter_config: Mapping[str, Any]) -> float:
    """PEFT's scale of a module: alpha / r (alpha / sqrt(r) with use_rslora), r and alpha from rank_pattern and
    alpha_pattern where a key matches the module (as PEFT matches them), else r and lora_alpha (PEFT's defaults 8
    and 8). The tensors' rank must be the configured r: the scale depends on it."""
    r = _pattern_value(adapter_config.get("rank_pattern"), module, adapter_config.get("r", 8))
    alpha = _pattern_value(adapter_config.get("alpha_pattern"), module, adapter_config.get("lora_alpha", 8))
    if r != rank:
        raise ValueError(
            f"LoRA module {module!r} has rank {rank}; its adapter_config (r, rank_pattern) says {r}"
        )
    return alpha / (math.sqrt(r) if adapter_config.get("use_rslora") else r)


def _pattern_value(pattern: Mapping[str, Any] | None, module: str, default: Any) -> Any:
    """PEFT's get_pattern_key: the first key that matches the end of the module's name, at a "." boundary."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _float32(tensor: Any) -> np.ndarray:
    """A numpy, jax or torch array as float32 numpy (torch's by duck typing: no torch import here)."""
    if hasattr(tensor, "detach"):
        tensor = tensor.detach().float().cpu().numpy()
    return np.asarray(tensor, np.float32)


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as numpy (memory-mapped; bfloat16 as ml_dtypes'), floats only."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as file:
        tensors = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118 (not a dict)
    for name, tensor in tensors.items():
        if tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {tensor.dtype}; LoRA weights must be floats")
    return tensors
