"""How a model pools its hidden states into an embedding, as its sentence-transformers config says (modules.json,
the Pooling module's config.json, a Normalize module), and which output sizes it allows (Matryoshka, from the HF
config's `is_matryoshka` / `matryoshka_dimensions`), read as vLLM reads them.

Without a sentence-transformers config, vLLM's default for a decoder converted to embed: the last token's hidden
state (after the final norm), L2-normalised."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

POOLING_TYPES = ("last", "mean", "cls")
# sentence-transformers' Pooling config flags -> our pooling types; any other mode set is refused by name.
_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
POOLING_MODULE = "sentence_transformers.models.Pooling"
NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
TRANSFORMER_MODULE = "sentence_transformers.models.Transformer"


@dataclass(frozen=True)
class PoolerConfig:
    """The pooling of an embedding model: `pooling_type` one of POOLING_TYPES; `normalize` the default for a
    request that does not say; `matryoshka_dimensions` the output sizes it was trained for (None: any size up to
    `hidden_size` once `is_matryoshka`)."""

    pooling_type: str = "last"
    normalize: bool = True
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")

    def check_dimensions(self, dimensions: int | None, hidden_size: int) -> None:
        """`dimensions` (a request's output size) must be one this model was trained to truncate to."""
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise ValueError(
                "dimensions: this model does not support matryoshka representation (its config sets no "
                "is_matryoshka / matryoshka_dimensions): changing output dimensions would give poor embeddings"
            )
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            raise ValueError(
                f"dimensions must be one of the model's matryoshka dimensions {list(self.matryoshka_dimensions)}, "
                f"got {dimensions}"
            )
        if not 1 <= dimensions <= hidden_size:
            raise ValueError(
                f"dimensions must be in [1, {hidden_size}] (the model's hidden size), got {dimensions}"
            )


def pooler_config_for(model_dir: Path | None) -> PoolerConfig:
    """The pooling `model_dir` names (its sentence-transformers config), else the default (see the module doc)."""
    if model_dir is None or not model_dir.is_dir():
        return PoolerConfig()
    matryoshka = _matryoshka(model_dir / "config.json")
    modules_file = model_dir / "modules.json"
    if not modules_file.exists():
        return PoolerConfig(**matryoshka)
    modules = json.loads(modules_file.read_text())
    known = (POOLING_MODULE, NORMALIZE_MODULE, TRANSFORMER_MODULE)
    other = [m.get("type") for m in modules if m.get("type") not in known]
    if other:
        raise ValueError(f"{modules_file}: sentence-transformers modules {other} are not supported")
    pooling = next((m for m in modules if m.get("type") == POOLING_MODULE), None)
    pooling_type = (
        "last" if pooling is None else _pooling_type(model_dir / pooling.get("path", "") / "config.json")
    )
    normalize = any(m.get("type") == NORMALIZE_MODULE for m in modules)
    return PoolerConfig(pooling_type, normalize, **matryoshka)


def _pooling_type(config_file: Path) -> str:
    config = json.loads(config_file.read_text())
    unsupported = [mode for mode in _UNSUPPORTED_MODES if config.get(mode)]
    chosen = [pooling for mode, pooling in _MODES.items() if config.get(mode)]
    if unsupported or len(chosen) != 1:
        raise ValueError(
            f"{config_file}: exactly one of {sorted(_MODES)} must be set (got "
            f"{[m for m in (*_MODES, *_UNSUPPORTED_MODES) if config.get(m)]})"
        )
    return chosen[0]


def _matryoshka(config_file: Path) -> dict:
    if not config_file.exists():
        return {}
    config = json.loads(config_file.read_text())
    dimensions = config.get("matryoshka_dimensions")
    return {
        "is_matryoshka": bool(dimensions) or bool(config.get("is_matryoshka", False)),
        "matryoshka_dimensions": tuple(dimensions) if dimensions else None,
    }
