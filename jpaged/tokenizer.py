"""Tokenizer glue: load the model's tokenizer (caching GGUF conversions), EOS ids and chat templates."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def _cache_dir() -> Path:
    root = os.environ.get("JPAGED_CACHE_DIR") or Path.home() / ".cache" / "jpaged"
    return Path(root) / "gguf-tokenizers"


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The transformers tokenizer saved in an HF or orbax directory."""
    return AutoTokenizer.from_pretrained(str(path))


def load_gguf_tokenizer(gguf_path: Path, fields: dict) -> PreTrainedTokenizerBase:
    """The tokenizer built from a GGUF file's vocabulary (`fields` from gguf_metadata.read_gguf_fields).

    Building it takes seconds, so the result is saved once under ~/.cache/jpaged, keyed by the file's identity,
    and reloaded from there afterwards.
    """
    from jpaged.models.gguf_metadata import gguf_tokenizer

    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    cached = _cache_dir() / key[:24]
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    tokenizer = gguf_tokenizer(fields)
    with contextlib.suppress(OSError):  # a read-only home only costs the conversion next time
        tokenizer.save_pretrained(str(cached))
    return tokenizer


def eos_token_ids(config_eos: Sequence[int], tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """Every id that ends generation: the model config's (and generation config's) plus the tokenizer's."""
    ids = list(config_eos)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return tuple(ids)


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **template_kwargs,
) -> list[int]:
    """Token ids of `messages` rendered with the model's (or the given) chat template."""
    if chat_template is None and tokenizer.chat_template is None:
        raise ValueError("the model has no chat template; pass chat_template")
    text = tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        **template_kwargs,
    )
    return tokenizer.encode(text, add_special_tokens=False)
