"""Gemma 3 4B, 12B and 27B as published (Gemma3ForConditionalGeneration, model_type `gemma3`): an image-text model
whose language model is a Gemma 3 text model (gemma3.py), served here for text. Its config.json nests the text
model's under `text_config` with only what differs from transformers' defaults, so transformers' own
Gemma3TextConfig fills the rest in; its checkpoint names the text model's tensors under `language_model.`; the
vision tower and projector are not read."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from jpaged.models.families import gemma3
from jpaged.models.families.family import Family
from jpaged.models.families.gemma2 import gemma_checkpoint

if TYPE_CHECKING:
    from jpaged.models.config import ModelConfig
    from jpaged.models.params import LeafRecipe


def _text_model(hf: Mapping[str, Any]) -> dict[str, Any]:
    import transformers

    text = transformers.Gemma3TextConfig(**hf.get("text_config", {})).to_dict()
    # generation_config.json's EOS ids are read into the outer config (weights.read_hf_config).
    return {**text, **{key: hf[key] for key in ("eos_token_id", "bos_token_id") if key in hf}}


def _checkpoint(config: ModelConfig) -> dict[str, LeafRecipe]:
    recipes = gemma_checkpoint(config)
    return {
        path: replace(r, names=tuple("language_model." + n for n in r.names)) for path, r in recipes.items()
    }


FAMILY = Family(
    model_type="gemma3",
    architectures=("Gemma3ForConditionalGeneration",),
    special="Gemma 3 4B-27B as published: the text model of the image-text checkpoint (its vision tower unread)",
    features=gemma3.FAMILY.features,
    checkpoint=_checkpoint,
    text_model=_text_model,
)
