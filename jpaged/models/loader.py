"""Find a model (path, GGUF file, orbax checkpoint, hub id, or the embedded default) and load it.

Every source yields the same `LoadedModel`: a ModelConfig, the params pytree (numpy, on host) and a tokenizer.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from flax.traverse_util import unflatten_dict
from transformers import PreTrainedTokenizerBase

from jpaged.models.checkpoint import (
    ORBAX_MARKER,
    holds_quantized_matrices,
    lazy_checkpoint,
    restore_checkpoint,
)
from jpaged.models.checkpoint_quantization import quantized_reader
from jpaged.models.config import ModelConfig
from jpaged.models.default_model import default_model_path
from jpaged.models.gguf_cache import load_converted, store_converted
from jpaged.models.gguf_metadata import gguf_model_config, gguf_tokenizer, read_gguf_fields
from jpaged.models.grouped import is_grouped
from jpaged.models.lazy_weights import FusedWeight
from jpaged.models.params import hf_recipes, param_stats, params_from_hf_names
from jpaged.models.products import is_whole_leaf
from jpaged.models.quantized import QuantizedMatrix
from jpaged.models.weights import (
    gguf_reader,
    read_hf_config,
    read_quantization_config,
    safetensors_reader,
    safetensors_slicer,
)

logger = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


@dataclasses.dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf" | "gguf" | "orbax", or "params" for weights handed over in memory (LLM.from_params)
    path: Path  # the directory (hf, orbax) or the .gguf file


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict
    tokenizer: PreTrainedTokenizerBase
    source: ModelSource
    load_seconds: float


def resolve_model(model: str | None) -> ModelSource:
    """Where `model` lives and in what format; a hub id is downloaded (it needs network access)."""
    if model is None:
        return ModelSource("gguf", default_model_path())
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file; give a GGUF file or a model directory")
        return ModelSource("gguf", path)
    if path.is_dir():
        if (path / ORBAX_MARKER).exists():
            return ModelSource("orbax", path)
        if (path / "config.json").exists():
            return ModelSource("hf", path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0])
        raise ValueError(f"model directory {path} has no config.json, {ORBAX_MARKER} or single .gguf file")
    if _HUB_ID.match(model) and not model.startswith("."):
        return ModelSource("hf", _download(model))
    raise ValueError(f"model path {model!r} does not exist")


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(
            repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
        )
    except Exception as err:  # the hub client raises many types; all mean the same to a user
        raise ValueError(
            f"could not fetch {repo_id!r} from the Hugging Face hub (offline, unknown repo or no access): {err}"
        ) from err
    return Path(local)


def load_model(
    model: str | None = None,
    dtype=np.float32,
    *,
    progress: bool = True,
    lazy: bool = False,
    keep_blocks: bool = False,
) -> LoadedModel:
    """Load config, params and tokenizer from any supported source; logs time, parameter count and bytes.
    `keep_blocks`: a quantized checkpoint's layer matrices stay quantized (a GGUF's blocks of the types the kernels
    read, models/gguf_blocks.py; an HF checkpoint's with a quantization_config, models/checkpoint_quantization.py),
    the rest is cast to `dtype`; without it they are dequantised.

    `lazy` (for tensor parallelism): HF safetensors and the GGUF conversion cache give lazy weights, read only
    where indexed (lazy_weights.py), orbax checkpoints CheckpointedWeights that tensor parallelism restores into
    their shards; a GGUF's first conversion and quantized checkpoints are read whole on the host (each device is
    then given its part of them)."""
    start = time.perf_counter()
    source = resolve_model(model)
    if source.kind == "orbax":
        if holds_quantized_matrices(source.path):  # read whole
            config, params = restore_checkpoint(source.path, dtype, keep=keep_blocks)
        else:
            config, params = (lazy_checkpoint if lazy else restore_checkpoint)(source.path, dtype)
        tokenizer = load_tokenizer(source.path)
    elif source.kind == "hf":
        config = read_hf_config(source.path)
        quantization = read_quantization_config(source.path)
        if lazy and quantization is None:
            slicer = safetensors_slicer(source.path)
            recipes = hf_recipes(config).items()
            flat = {
                path: FusedWeight.of(recipe, slicer, config.num_layers, dtype, config.num_experts)
                for path, recipe in recipes
            }
            params = unflatten_dict(flat, sep="/")
        else:
            get, names = safetensors_reader(source.path)
            if quantization is not None:
                get = quantized_reader(quantization, get, names, keep=keep_blocks)
            params = _standing_for(params_from_hf_names(config, get, dtype, progress=progress), dtype)
        tokenizer = load_tokenizer(source.path)
    else:
        converted = load_converted(source.path, dtype, lazy=lazy and not keep_blocks, blocks=keep_blocks)
        if converted is None:
            fields = read_gguf_fields(source.path)
            config = gguf_model_config(fields)
            reader = gguf_reader(source.path, fields, config, keep_blocks=keep_blocks)
            params = params_from_hf_names(config, reader, np.float32, progress=progress)
            tokenizer = gguf_tokenizer(fields)
            store_converted(source.path, config, params, tokenizer, blocks=keep_blocks)
            params = _standing_for(params, dtype)
        else:
            config, params, tokenizer = converted
    config = dataclasses.replace(config, eos_token_ids=eos_token_ids(config.eos_token_ids, tokenizer))
    seconds = time.perf_counter() - start
    count, nbytes = param_stats(params)
    logger.info(
        "loaded %s (%s, %s) in %.2f s: %.1fM parameters, %.1f MiB",
        source.path,
        source.kind,
        config.architecture,
        seconds,
        count / 1e6,
        nbytes / 2**20,
    )
    return LoadedModel(config, params, tokenizer, source, seconds)


def _standing_for(params: dict, dtype) -> dict:
    """Float leaves cast to `dtype`, GroupedMatrix leaves standing for it (a QuantizedMatrix computes in any)."""

    def cast(leaf):
        if isinstance(leaf, QuantizedMatrix):
            return leaf
        return leaf.standing_for(dtype) if is_grouped(leaf) else leaf.astype(dtype, copy=False)

    return jax.tree_util.tree_map(cast, params, is_leaf=is_whole_leaf)


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The transformers tokenizer saved in an HF or orbax directory."""
    from transformers import AutoTokenizer  # imported here: it pulls in torch where torch is installed

    return AutoTokenizer.from_pretrained(str(path))


def eos_token_ids(config_eos: Sequence[int], tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Every id that ends generation: the model config's (and generation config's) plus the tokenizer's."""
    ids = list(config_eos)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return tuple(ids)
