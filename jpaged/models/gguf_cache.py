"""GGUF files are converted once: the result (params as safetensors, the config, the tokenizer) is kept under
$JPAGED_CACHE_DIR (default ~/.cache/jpaged)/gguf, keyed by the file's path, size and modification time and by the
form of the params: float32, or with the quantized matrices kept as blocks (GroupedMatrix: its codes, scale and bias
stored as `<path>#codes`..., its bits and orientation in the file's metadata).

Parsing a GGUF's metadata (a 49k-entry vocabulary) and dequantising its tensors takes many times longer than
reading the converted copy back (README: loading the default model). A read-only or full cache directory only
costs the conversion next time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from jpaged.models.config import ModelConfig
from jpaged.models.held_matrices import as_arrays, from_arrays
from jpaged.models.lazy_weights import StoredWeight

logger = logging.getLogger(__name__)

FORMAT_VERSION = 4  # bump when the conversion changes, so older copies are not reused
_CONFIG_FILE = "jpaged_config.json"  # not config.json: transformers would read it as its own
_PARAMS_FILE = "params.safetensors"


def cache_root() -> Path:
    return Path(os.environ.get("JPAGED_CACHE_DIR") or Path.home() / ".cache" / "jpaged")


def converted_dir(gguf_path: Path, blocks: bool = False) -> Path:
    stat = gguf_path.stat()
    form = ":blocks" if blocks else ""
    identity = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{FORMAT_VERSION}{form}"
    return cache_root() / "gguf" / hashlib.sha256(identity.encode()).hexdigest()[:24]


def load_converted(
    gguf_path: Path, dtype, *, lazy: bool = False, blocks: bool = False
) -> tuple[ModelConfig, dict, PreTrainedTokenizerBase] | None:
    """The cached conversion of `gguf_path` (float params cast to `dtype`, blocks kept as they are; lazy: read
    where indexed, see lazy_weights.py), or None when there is none yet."""
    directory = converted_dir(gguf_path, blocks)
    if not (directory / _PARAMS_FILE).exists():
        return None
    config = ModelConfig.from_json_dict(json.loads((directory / _CONFIG_FILE).read_text()))
    if lazy:
        file = safe_open(directory / _PARAMS_FILE, framework="numpy")
        flat = {}
        for name in file.keys():  # noqa: SIM118 (a safetensors file, not a dict)
            tensor = file.get_slice(name)
            flat[name] = StoredWeight(tensor, tuple(tensor.get_shape()), np.dtype(dtype))
    else:
        flat = _regrouped(directory / _PARAMS_FILE, dtype)
    params = unflatten_dict(flat, sep="/")
    return config, params, PreTrainedTokenizerFast.from_pretrained(str(directory))


def _regrouped(file: Path, dtype) -> dict:
    """A stored conversion's flat params: float ones cast to `dtype`, GroupedMatrix ones put back together."""
    with safe_open(file, framework="numpy") as stored:
        forms = {name: json.loads(form) for name, form in (stored.metadata() or {}).items()}
    return from_arrays(load_file(file), forms, dtype, sep="#")


def store_converted(
    gguf_path: Path, config: ModelConfig, params: dict, tokenizer, *, blocks: bool = False
) -> None:
    """Save a conversion; written to a temporary directory and renamed, so a reader never sees half of one."""
    directory = converted_dir(gguf_path, blocks)
    partial = directory.with_name(directory.name + f".partial-{os.getpid()}")
    arrays, forms = as_arrays(flatten_dict(params, sep="/"), sep="#")
    flat = {name: np.ascontiguousarray(a, None if "#" in name else np.float32) for name, a in arrays.items()}
    forms = {name: json.dumps(form) for name, form in forms.items()}
    try:
        partial.mkdir(parents=True, exist_ok=True)
        save_file(flat, partial / _PARAMS_FILE, metadata=forms or None)
        (partial / _CONFIG_FILE).write_text(json.dumps(config.to_json_dict(), indent=2))
        tokenizer.save_pretrained(str(partial))
        partial.rename(directory)
    except OSError as err:
        logger.warning("could not cache the converted GGUF under %s: %s", directory, err)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(partial)
