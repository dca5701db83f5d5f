"""Tokenizer glue: load the model's tokenizer, EOS ids and chat templates."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerBase


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
