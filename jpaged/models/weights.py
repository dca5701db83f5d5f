"""Read weights from disk: HF safetensors directories and GGUF files, both into transformers' names."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jpaged.models.config import ModelConfig
from jpaged.models.families import family_of
from jpaged.models.gguf_blocks import grouped_tensor
from jpaged.models.grouped import is_grouped
from jpaged.models.params import GetTensor


def read_hf_config(model_dir: Path) -> ModelConfig:
    """ModelConfig from `config.json`, with EOS ids from `generation_config.json` when it lists more."""
    config_path = model_dir / "config.json"
    try:
        hf = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read model config {config_path}: {err}") from err
    generation = model_dir / "generation_config.json"
    if generation.exists():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        if eos is not None:
            hf["eos_token_id"] = eos
    return ModelConfig.from_hf_config(hf)


def read_quantization_config(model_dir: Path) -> dict | None:
    """config.json's `quantization_config` (a checkpoint shipped quantized), if it has one."""
    return json.loads((model_dir / "config.json").read_text()).get("quantization_config")


def _safetensors_files(model_dir: Path) -> tuple[Callable[[str], Any], frozenset[str]]:
    """name -> (the open (memory-mapped) safetensors file holding it, its name there), and the names, over every
    `*.safetensors` shard of a directory (sharded index or not). A base model's checkpoint (transformers'
    AutoModel, as sentence-transformers saves embedding models) names its tensors without the "model." prefix:
    they answer to the prefixed names too."""
    from safetensors import safe_open

    _float8_for_safetensors()
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir}")
    where = {}
    for handle in (safe_open(str(f), framework="numpy") for f in files):
        for key in handle.keys():  # noqa: SIM118 (a safetensors file, not a dict)
            where[key] = (handle, key)
            if key.startswith(("embed_tokens.", "layers.", "norm.")):
                where.setdefault("model." + key, (handle, key))

    def file_of(name: str):
        if name not in where:
            raise ValueError(f"weight {name!r} missing from {model_dir}")
        return where[name]

    return file_of, frozenset(where)


def _float8_for_safetensors() -> None:
    """safetensors' numpy reader looks float8 types up on the numpy module, which has none: ml_dtypes' (numpy's
    float8 types, as jax uses them) stand there, so FP8 checkpoints read as numpy arrays like any other."""
    import ml_dtypes

    for name in ("float8_e4m3fn", "float8_e5m2"):
        if not hasattr(np, name):
            setattr(np, name, getattr(ml_dtypes, name))


def safetensors_reader(model_dir: Path) -> tuple[GetTensor, frozenset[str]]:
    """name -> the whole array, and the names there are."""
    file_of, names = _safetensors_files(model_dir)

    def get(name: str) -> np.ndarray:
        handle, stored = file_of(name)
        return handle.get_tensor(stored)

    return get, names


def safetensors_slicer(model_dir: Path) -> Callable[[str], Any]:
    """name -> the tensor's slice handle: indexing it reads just that part."""
    file_of, _ = _safetensors_files(model_dir)

    def get(name: str):
        handle, stored = file_of(name)
        return handle.get_slice(stored)

    return get


def gguf_reader(path: Path, fields: dict, config: ModelConfig, *, keep_blocks: bool = False) -> GetTensor:
    """Dequantised GGUF tensors under transformers' names, as llama.cpp's converter wrote them undone: its Q/K row
    permutation (llama) and its norm weights stored as (norm_offset + w) (Gemma). gguf's own tensor-name map for the
    file's architecture names each transformers tensor, so a family's checkpoint names (Gemma's
    `pre_feedforward_layernorm`, Phi-3's fused `qkv_proj`) find their GGUF tensors without a table here.
    `keep_blocks`: matrices of a block type the kernels read come as GroupedMatrix (gguf_blocks.py). Reads the
    tensors of the `fields` read_gguf_fields gave for `path` (the file is parsed once: its metadata takes seconds)."""
    from gguf.quants import dequantize

    tensors = fields["_tensors"]
    names = _gguf_name_map(fields["general.architecture"], config.num_layers)
    permutes_qk = family_of(config.architecture).gguf_permutes_qk

    def get(name: str) -> np.ndarray:
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name not in tensors:
            raise ValueError(f"weight {name!r} ({gguf_name or 'no GGUF name'}) missing from {path}")
        tensor = tensors.stored(gguf_name)
        array = grouped_tensor(tensor) if keep_blocks else None
        if array is None:
            shape = tuple(int(d) for d in reversed(tensor.shape))
            array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if permutes_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            if is_grouped(array):  # its rows are the stored arrays' columns
                array = jax.tree_util.tree_map(lambda stored: _unpermute_rows(stored.T, heads).T, array)
            else:
                array = _unpermute_rows(array, heads)
        if config.norm_offset and name.endswith("norm.weight"):
            array = array - np.float32(config.norm_offset)
        return array

    return get


def _gguf_name_map(architecture: str, num_layers: int):
    """gguf's map from transformers' tensor names to llama.cpp's for one architecture."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((a for a, name in MODEL_ARCH_NAMES.items() if name == architecture), None)
    if arch is None:
        raise ValueError(f"GGUF architecture {architecture!r} is unknown to the installed gguf library")
    return get_tensor_name_map(arch, num_layers)


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
