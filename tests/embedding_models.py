"""Tiny random embedding models for the embedding tests: a transformers decoder saved with a sentence-transformers
config beside it (modules.json, 1_Pooling/config.json, optionally a Normalize module), and the reference
embeddings from transformers itself (AutoModel's last hidden states, pooled and normalised the same way)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
from conftest import TINY

POOLING_FLAGS = {
    "last": "pooling_mode_lasttoken",
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
}
# Qwen3-Embedding's shape: a base Qwen3Model checkpoint (tensors named without "model."), tied embeddings.
FAMILIES = {
    "qwen3": ("Qwen3Config", dict(TINY, head_dim=32, tie_word_embeddings=True)),
    "llama": ("LlamaConfig", dict(TINY, tie_word_embeddings=True)),
}


def save_embedding_model(
    root: str,
    family: str,
    pooling: str,
    normalize: bool = True,
    matryoshka_dimensions: tuple[int, ...] | None = None,
    tokenizer=None,
) -> Path:
    """A directory holding a tiny random base model of `family` (transformers' AutoModel, seeded), the tokenizer,
    and a sentence-transformers config that pools with `pooling` (and normalises if `normalize`)."""
    import torch
    import transformers

    path = Path(root) / f"{family}-{pooling}-{normalize}-{matryoshka_dimensions}"
    if (path / "modules.json").exists():
        return path
    class_name, kwargs = FAMILIES[family]
    config = getattr(transformers, class_name)(**kwargs)
    if matryoshka_dimensions is not None:
        config.matryoshka_dimensions = list(matryoshka_dimensions)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    flags = dict.fromkeys(POOLING_FLAGS.values(), False) | {POOLING_FLAGS[pooling]: True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **flags}))
    return path


@functools.cache
def _hf_base_model(path: Path):
    import torch
    import transformers

    return transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()


def hf_embedding(
    path: Path,
    token_ids: list[int],
    pooling: str,
    normalize: bool = True,
    dimensions: int | None = None,
) -> np.ndarray:
    """transformers' last hidden states of `token_ids` [T, D], pooled, truncated to `dimensions`, normalised."""
    import torch

    with torch.no_grad():
        hidden = _hf_base_model(path)(torch.tensor([token_ids])).last_hidden_state[0].double().numpy()
    pooled = {"last": hidden[-1], "mean": hidden.mean(axis=0), "cls": hidden[0]}[pooling][:dimensions]
    return pooled / np.linalg.norm(pooled) if normalize else pooled
