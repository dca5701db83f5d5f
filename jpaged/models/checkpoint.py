"""orbax checkpoints of a CausalLM's state (its nnx state dict): convert once from any source, then restore fast,
whole into host arrays, or (tensor parallelism) each leaf straight into its devices' shards."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from jpaged.models.config import ModelConfig
from jpaged.models.lazy_weights import LazyWeight
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


def _read_config(directory: Path) -> ModelConfig:
    return ModelConfig.from_json_dict(json.loads((directory / ORBAX_MARKER).read_text()))


def restore_checkpoint(directory: Path, dtype=np.float32) -> tuple[ModelConfig, dict]:
    """Config and params (numpy, `dtype`) from a directory written by `save_checkpoint`. They are restored into
    host arrays: left to itself orbax would place each on the device it was saved from."""
    import orbax.checkpoint as ocp

    directory = Path(directory).resolve()
    config = _read_config(directory)
    with ocp.StandardCheckpointer() as checkpointer:
        saved = checkpointer.metadata(directory / "params").item_metadata
        host = jax.tree_util.tree_map(lambda leaf: np.empty(leaf.shape, leaf.dtype), saved)
        restored = checkpointer.restore(directory / "params", host)
    return config, jax.tree_util.tree_map(lambda x: np.asarray(x, dtype=dtype), restored)


@dataclass(frozen=True, eq=False)
class CheckpointedWeight(LazyWeight):
    """A leaf of an orbax checkpoint, not read yet. Tensor parallelism restores the leaves straight into their
    shards, each process reading only its own devices' parts (`restore_sharded`); indexing reads this leaf
    alone, whole."""

    params_dir: Path  # the checkpoint's params
    key: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype

    def __getitem__(self, index) -> np.ndarray:
        import orbax.checkpoint as ocp

        def nested(leaf):
            for name in reversed(self.key):
                leaf = {name: leaf}
            return leaf

        args = ocp.args.PyTreeRestore(
            item=nested(np.empty(self.shape, self.dtype)),
            restore_args=nested(ocp.RestoreArgs(restore_type=np.ndarray, dtype=self.dtype)),
            partial_restore=True,
        )
        with ocp.PyTreeCheckpointer() as checkpointer:
            restored = checkpointer.restore(self.params_dir, args=args)
        for name in self.key:
            restored = restored[name]
        return np.asarray(restored)[index]


def lazy_checkpoint(directory: Path, dtype=np.float32) -> tuple[ModelConfig, dict]:
    """Config and params (CheckpointedWeight leaves of `dtype`) from a directory written by `save_checkpoint`,
    reading no weight yet."""
    import orbax.checkpoint as ocp

    directory = Path(directory).resolve()
    with ocp.StandardCheckpointer() as checkpointer:
        saved = checkpointer.metadata(directory / "params").item_metadata

    def leaf(path, metadata) -> CheckpointedWeight:
        key = tuple(str(entry.key) for entry in path)
        return CheckpointedWeight(directory / "params", key, tuple(metadata.shape), np.dtype(dtype))

    return _read_config(directory), jax.tree_util.tree_map_with_path(leaf, saved.tree)


def restore_sharded(params: dict, shardings: dict) -> dict:
    """CheckpointedWeight params restored as jax.Arrays of these shardings, in one orbax restore: each process
    reads only its own devices' parts of each leaf (a collective under jax.distributed: every process calls it)."""
    import orbax.checkpoint as ocp

    (params_dir,) = {w.params_dir for w in jax.tree_util.tree_leaves(params)}
    abstract = jax.tree_util.tree_map(
        lambda w, sharding: jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding), params, shardings
    )
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(params_dir, abstract)
