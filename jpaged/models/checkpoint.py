"""orbax checkpoints of a CausalLM's state (its nnx state dict): convert once from any source, then restore fast,
whole into host arrays, or (tensor parallelism) each leaf straight into its devices' shards."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from jpaged.models.config import ModelConfig
from jpaged.models.held_matrices import as_arrays, from_arrays
from jpaged.models.lazy_weights import LazyWeight
from jpaged.models.llama import as_params
from jpaged.models.params import dequantized

ORBAX_MARKER = "jpaged_model.json"  # marks a directory written by save_checkpoint
_FORMS = "quantized_matrices.json"  # the quantized matrices' forms (held_matrices.py), where there are any


def save_checkpoint(directory: Path, config: ModelConfig, weights, tokenizer) -> None:
    """Write `directory/params` (orbax; a CausalLM, its nnx.State or its state dict), the model config and the
    tokenizer files. Quantized matrices are written as their arrays, with the forms that rebuild them."""
    import orbax.checkpoint as ocp

    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    arrays, forms = as_arrays(flatten_dict(as_params(weights), sep="/"), sep="/")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / "params", unflatten_dict(arrays, sep="/"), force=True)
    (directory / _FORMS).unlink(missing_ok=True)
    if forms:
        (directory / _FORMS).write_text(json.dumps(forms, indent=2))
    (directory / ORBAX_MARKER).write_text(json.dumps(config.to_json_dict(), indent=2))
    tokenizer.save_pretrained(str(directory))


def _read_config(directory: Path) -> ModelConfig:
    return ModelConfig.from_json_dict(json.loads((directory / ORBAX_MARKER).read_text()))


def holds_quantized_matrices(directory: Path) -> bool:
    return (Path(directory) / _FORMS).exists()


def restore_checkpoint(directory: Path, dtype=np.float32, *, keep: bool = True) -> tuple[ModelConfig, dict]:
    """Config and params (numpy, `dtype`) from a directory written by `save_checkpoint`, quantized matrices kept
    (or, without `keep`, dequantised). They are restored into host arrays: left to itself orbax would place each on
    the device it was saved from."""
    import orbax.checkpoint as ocp

    directory = Path(directory).resolve()
    config = _read_config(directory)
    with ocp.StandardCheckpointer() as checkpointer:
        saved = checkpointer.metadata(directory / "params").item_metadata
        host = jax.tree_util.tree_map(lambda leaf: np.empty(leaf.shape, leaf.dtype), saved)
        restored = checkpointer.restore(directory / "params", host)
    forms = json.loads((directory / _FORMS).read_text()) if holds_quantized_matrices(directory) else {}
    flat = from_arrays(flatten_dict(restored, sep="/"), forms, dtype, sep="/")
    if not keep:
        flat = {path: np.asarray(dequantized(leaf), dtype) for path, leaf in flat.items()}
    return config, unflatten_dict(flat, sep="/")


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
