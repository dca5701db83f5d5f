"""The model families jpaged runs, by HF `model_type`: each a module beside this one (family.py says what one
declares). Adding a family is its module and one line here; README's family table is `family_table()`."""

from __future__ import annotations

from jpaged.models.families import (
    gemma2,
    gemma3,
    gemma3_image_text,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)
from jpaged.models.families.family import Family

FAMILIES: dict[str, Family] = {
    module.FAMILY.model_type: module.FAMILY
    for module in (
        llama,
        mistral,
        qwen2,
        qwen3,
        phi3,
        gemma2,
        gemma3,
        gemma3_image_text,
        qwen3_moe,
        qwen2_moe,
        mixtral,
        gpt_oss,
    )
}


def family_of(model_type: str, architectures=None) -> Family:
    """The family of an HF `model_type`; a ValueError listing the registry's families for any other."""
    if model_type not in FAMILIES:
        named = f" (architectures={architectures})" if architectures else ""
        raise ValueError(
            f"unsupported architecture {model_type!r}{named}; jpaged supports {', '.join(FAMILIES)}"
        )
    return FAMILIES[model_type]


def gguf_family(gguf_architecture: str) -> Family:
    """The family of a GGUF file's `general.architecture`."""
    for family in FAMILIES.values():
        if family.gguf_architecture == gguf_architecture:
            return family
    readable = [f.gguf_architecture for f in FAMILIES.values() if f.gguf_architecture]
    raise ValueError(
        f"unsupported architecture {gguf_architecture!r} in GGUF; jpaged supports {', '.join(readable)}"
    )


def family_table() -> str:
    """README's table of the supported families, as markdown."""
    rows = ["| family | HF architectures | what is special | loaders |", "|---|---|---|---|"]
    for family in FAMILIES.values():
        architectures = ", ".join(f"`{a}`" for a in family.architectures)
        rows.append(
            f"| {family.model_type} | {architectures} | {family.special} | {', '.join(family.loaders)} |"
        )
    return "\n".join(rows)
