"""Tokenizer glue on the engine's side: what the engine needs of a tokenizer, chat templates, bad words."""

from __future__ import annotations

from typing import Protocol

import jinja2
from transformers import PreTrainedTokenizerBase


class Tokenizer(Protocol):
    """What the engine uses of a tokenizer (transformers' tokenizers have both; tests pass small fakes)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ..., **kwargs) -> str: ...


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    add_special_tokens: bool = False,
    **template_kwargs,
) -> list[int]:
    """Token ids of `messages` rendered with the model's (or the given) chat template; the template writes its
    own special tokens, so the tokenizer adds none unless `add_special_tokens` (vLLM's chat default too)."""
    if chat_template is None and tokenizer.chat_template is None:
        raise ValueError("the model has no chat template; pass chat_template")
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            **template_kwargs,
        )
    except (
        jinja2.TemplateError
    ) as err:  # a template refuses what its model cannot take (Gemma: a system role)
        raise ValueError(f"the chat template rejected the messages: {err}") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def tokenize_bad_words(bad_words: list[str], tokenizer: Tokenizer) -> list[list[int]]:
    """Token sequences to ban for each bad word, at the start of the text and mid-text (vLLM's rule).

    A word tokenises differently with a leading space, so both forms are banned; the spaced form is kept
    only when it really is a different word token of the same length (as vLLM's update_from_tokenizer).
    """
    sequences: list[list[int]] = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words entry {word!r} tokenises to no tokens")
        sequences.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences
