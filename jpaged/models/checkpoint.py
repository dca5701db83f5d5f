"""orbax checkpoints of a CausalLM's state (its nnx state dict): convert once from any source, then restore fast."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from jpaged.models.config import ModelConfig
from jpaged.models.llama import as_params

ORBAX_MARKER = "jpaged_model.json"  # marks a directory written by save_checkpoint


def save_checkpoint(directory: Path, config: ModelConfig, weights, tokenizer) -> None:
    """Write `directory/params` (orbax; a CausalLM, its nnx.State or its state dict), the model config and the
    tokenizer files."""
    import orbax.checkpoint as ocp

    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / "params", as_params(weights), force=True)
    (directory / ORBAX_MARKER).write_text(json.dumps(config.to_json_dict(), indent=2))
    tokenizer.save_pretrained(str(directory))


def restore_checkpoint(directory: Path, dtype=np.float32) -> tuple[ModelConfig, dict]:
    """Config and params (numpy, `dtype`) from a directory written by `save_checkpoint`. They are restored into
    host arrays: left to itself orbax would place each on the device it was saved from."""
    import orbax.checkpoint as ocp

    directory = Path(directory).resolve()
    config = ModelConfig.from_json_dict(json.loads((directory / ORBAX_MARKER).read_text()))
    with ocp.StandardCheckpointer() as checkpointer:
        saved = checkpointer.metadata(directory / "params").item_metadata
        host = jax.tree_util.tree_map(lambda leaf: np.empty(leaf.shape, leaf.dtype), saved)
        restored = checkpointer.restore(directory / "params", host)
    return config, jax.tree_util.tree_map(lambda x: np.asarray(x, dtype=dtype), restored)
