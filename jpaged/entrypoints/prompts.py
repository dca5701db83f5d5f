"""vLLM's prompt forms for the offline API: a str, a list of token ids, `{"prompt": str}` (TextPrompt) or
`{"prompt_token_ids": [...]}` (TokensPrompt), one of them or a list mixing them (or a [B, T] token array).

Each becomes an `EnginePrompt`: what the engine takes (text or token ids) and the cache salt a dict may carry."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral

from jpaged.entrypoints.arrays import is_array, prompt_rows

PromptType = str | Sequence[int] | Mapping
TEXT_KEY, TOKENS_KEY = "prompt", "prompt_token_ids"
KNOWN_KEYS = frozenset({TEXT_KEY, TOKENS_KEY, "cache_salt"})
# vLLM keys for inputs this engine has no model for: refused by name rather than ignored.
UNSUPPORTED_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "token_type_ids")


@dataclass(frozen=True, slots=True)
class EnginePrompt:
    prompt: str | list[int]
    cache_salt: str | None = None


def as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[EnginePrompt]:
    """Every prompt of `prompts` in order; ValueError naming what is wrong with a prompt of no known form."""
    return [engine_prompt(p, i) for i, p in enumerate(_as_list(prompts))]


def _as_list(prompts) -> list:
    if isinstance(prompts, str | Mapping):
        return [prompts]
    if is_array(prompts) and prompts.ndim == 1:
        return [[int(t) for t in prompts]]  # one prompt's token ids
    if is_array(prompts) or (prompts and all(is_array(p) for p in prompts)):
        return prompt_rows(prompts)  # a [B, T] array, or a list of 1-D arrays
    prompts = list(prompts)
    if prompts and all(isinstance(t, Integral) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def engine_prompt(prompt, index: int = 0) -> EnginePrompt:
    if isinstance(prompt, str):
        return EnginePrompt(prompt)
    if isinstance(prompt, Mapping):
        return _from_dict(prompt, index)
    if is_array(prompt):
        prompt = prompt.tolist()
    if isinstance(prompt, Sequence) and all(isinstance(t, Integral) for t in prompt):
        return EnginePrompt([int(t) for t in prompt])
    raise ValueError(
        f"prompts[{index}] must be a str, a list of token ids, {{'prompt': str}} or "
        f"{{'prompt_token_ids': [int, ...]}}, got {type(prompt).__name__}: {str(prompt)[:80]}"
    )


def _from_dict(prompt: Mapping, index: int) -> EnginePrompt:
    where = f"prompts[{index}]"
    for key in UNSUPPORTED_KEYS:
        if key in prompt:
            raise ValueError(f"{where}: {key} is not supported: jpaged serves text-only models")
    unknown = sorted(str(k) for k in prompt if k not in KNOWN_KEYS)
    if unknown:
        raise ValueError(
            f"{where} has unknown keys {unknown}: a prompt dict holds 'prompt' (text) or 'prompt_token_ids', "
            "and optionally 'cache_salt'"
        )
    if (TEXT_KEY in prompt) == (TOKENS_KEY in prompt):
        raise ValueError(
            f"{where} must hold exactly one of 'prompt' (text) and 'prompt_token_ids', got keys {sorted(prompt)}"
        )
    salt = prompt.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"{where}: cache_salt must be a str, got {type(salt).__name__}")
    if TEXT_KEY in prompt:
        text = prompt[TEXT_KEY]
        if not isinstance(text, str):
            raise ValueError(f"{where}: 'prompt' must be a str, got {type(text).__name__}")
        return EnginePrompt(text, salt)
    ids = prompt[TOKENS_KEY]
    if is_array(ids):
        ids = ids.tolist()
    if isinstance(ids, str) or not isinstance(ids, Sequence) or not all(isinstance(t, Integral) for t in ids):
        raise ValueError(f"{where}: 'prompt_token_ids' must be a list of ints, got {str(ids)[:80]}")
    return EnginePrompt([int(t) for t in ids], salt)
