"""Read weights from disk: HF safetensors directories and GGUF files, both into transformers' names."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from jpaged.models.config import ModelConfig
from jpaged.models.families import family_of
from jpaged.models.params import GetTensor

_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_TO_HF = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


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


def _safetensors_files(model_dir: Path) -> Callable[[str], Any]:
    """name -> (the open (memory-mapped) safetensors file holding it, its name there), over every
    `*.safetensors` shard of a directory (sharded index or not). A base model's checkpoint (transformers'
    AutoModel, as sentence-transformers saves embedding models) names its tensors without the "model." prefix:
    they answer to the prefixed names too."""
    from safetensors import safe_open

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

    return file_of


def safetensors_reader(model_dir: Path) -> GetTensor:
    """name -> the whole array."""
    file_of = _safetensors_files(model_dir)

    def get(name: str) -> np.ndarray:
        handle, stored = file_of(name)
        return handle.get_tensor(stored)

    return get


def safetensors_slicer(model_dir: Path) -> Callable[[str], Any]:
    """name -> the tensor's slice handle: indexing it reads just that part."""
    file_of = _safetensors_files(model_dir)

    def get(name: str):
        handle, stored = file_of(name)
        return handle.get_slice(stored)

    return get


def gguf_reader(path: Path, config: ModelConfig) -> GetTensor:
    """Dequantised GGUF tensors under transformers' names, with llama.cpp's Q/K row permutation undone."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {}
    for tensor in GGUFReader(str(path)).tensors:
        hf_name = _hf_name(tensor.name)
        if hf_name is not None:
            tensors[hf_name] = tensor

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"weight {name!r} missing from {path}")
        tensor = tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape))
        array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        # llama.cpp permutes Q/K rows for its interleaved RoPE on the llama architecture only.
        if family_of(config.architecture).gguf_permutes_qk and name.endswith(
            ("q_proj.weight", "k_proj.weight")
        ):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            array = _unpermute_rows(array, heads)
        return array

    return get


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_TO_HF:
        return _GGUF_TO_HF[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match is None or match.group(2) not in _GGUF_LAYER_TO_HF:
        return None
    return f"model.layers.{match.group(1)}.{_GGUF_LAYER_TO_HF[match.group(2)]}.{match.group(3)}"


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
