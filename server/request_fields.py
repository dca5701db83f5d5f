"""Which request fields this server ignores and which it refuses: the one place that says so.

A client written for vLLM or OpenAI sends fields this server does not declare. vLLM ignores what it does not know,
so a field that changes nothing must not cost the client its request: it is ignored, logged once per name, and
named in the response's `X-Jpaged-Ignored-Fields` header. A field that would change the output and is not
implemented is a 400 naming it, never silently dropped (UNSUPPORTED). `--strict-request-fields` refuses every
field the server does not know, as before these rules.
"""

from __future__ import annotations

import logging
import re

from jpaged_server.errors import APIError
from pydantic import BaseModel

logger = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "X-Jpaged-Ignored-Fields"

# OpenAI's and vLLM's fields that would change the output, and why they are not served here.
UNSUPPORTED: dict[str, str] = {
    "suffix": "text insertion (suffix) is not supported",
    "audio": "audio output is not supported",
    "web_search_options": "web search is not supported",
    "logits_processors": "custom logits processors are not supported",
    "prompt_embeds": "prompt embeddings are not supported",
    "chat_template": "a per-request chat template is not supported: start the server with --chat-template",
    "multi_modal_data": "multimodal inputs are not supported",
}

# Fields of OpenAI's or vLLM's API that change nothing a request returns here: accepted, named in the header.
WITHOUT_EFFECT: dict[str, str] = {
    "user": "an end-user id for abuse tracking",
    "store": "OpenAI's stored completions (chat); the Responses API has its own store",
    "metadata": "tags for OpenAI's dashboard",
    "service_tier": "OpenAI's processing tiers",
    "verbosity": "a hint for OpenAI's own models",
    "prompt_cache_key": "prefixes are cached whatever the key",
    "safety_identifier": "an end-user id for abuse tracking",
    "prediction": "predicted outputs only make OpenAI's decoding faster",
    "vllm_xargs": "arguments for custom logits processors, of which none are loaded",
    "spaces_between_special_tokens": "no effect on fast tokenizers, vLLM's too",
    "kv_transfer_params": "disaggregated prefill is not set up",
    "mm_processor_kwargs": "multimodal processing: text models only",
}

MAX_LOGGED_NAMES = 1024  # a client inventing names cannot grow the set of names logged without bound
MAX_NAMES_IN_HEADER = 32

_logged: set[str] = set()


def extra_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the fields `model` (and the request models inside it) did not declare; list items are
    written `name[]`, so the same field in every message is named once."""
    names = [f"{prefix}{name}" for name in model.model_extra or {}]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, BaseModel):
                inner = f"{prefix}{name}[]." if isinstance(value, list) else f"{prefix}{name}."
                names.extend(n for n in extra_fields(item, inner) if n not in names)
    return names


def check_request_fields(body: BaseModel, *, strict: bool) -> dict[str, str]:
    """The response headers that name the fields `body` sent to no effect; APIError(400) for a field that would
    change the output and is not implemented, or, when `strict`, for any field the server does not know."""
    extras = extra_fields(body)
    for name in extras:
        if name in UNSUPPORTED:
            raise APIError(400, f"{name}: {UNSUPPORTED[name]}", name)
    unknown = [name for name in extras if name not in WITHOUT_EFFECT]
    if strict and unknown:
        raise APIError(
            400,
            f"unknown or unsupported field {unknown[0]!r} (the server refuses unknown fields: "
            "--strict-request-fields)",
            unknown[0],
        )
    for name in unknown:
        if name not in _logged and len(_logged) < MAX_LOGGED_NAMES:
            _logged.add(name)
            logger.warning("ignoring the unknown request field %r (logged once per name)", name)
    return {IGNORED_FIELDS_HEADER: _header_value(extras)} if extras else {}


def _header_value(names: list[str]) -> str:
    """The names as one header value: escaped to printable ASCII (a name may hold any character JSON allows),
    at most MAX_NAMES_IN_HEADER of them."""
    shown = [_printable(name) for name in names[:MAX_NAMES_IN_HEADER]]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f", ... ({more} more)" if more else "")


def _printable(name: str) -> str:
    """A field name as printable ASCII with no comma (the header's separator) and no space at either end (a header
    value may not begin or end with one: the name " " would make the response unsendable); the empty name as
    `""`."""
    escaped = name.encode("unicode_escape").decode("ascii").replace(",", "\\x2c")
    return re.sub(r"^ +| +$", lambda spaces: "\\x20" * len(spaces.group()), escaped) or '""'
