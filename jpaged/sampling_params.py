"""Per-request sampling parameters with vLLM's names, defaults and validation ranges.

Users arrive with vLLM / OpenAI parameters, so the names and allowed ranges are vLLM's; every bad value raises
ValueError naming the field. Validation against the vocabulary needs the model, so it is a separate call
(`check_for_vocab`) that the engine makes once the model is known.
"""

from __future__ import annotations

import copy
import enum
import json
import math
from dataclasses import dataclass, fields

SAMPLING_EPS = 1e-5  # temperatures below this mean greedy (vLLM's _SAMPLING_EPS)
MIN_TEMPERATURE = 1e-2  # smaller positive temperatures overflow softmax; vLLM raises them to this
MAX_LOGPROBS = 20  # top-k logprobs cap (OpenAI's limit); every step computes this many when a row asks
MAX_LOGIT_BIAS = 100.0  # OpenAI/vLLM clamp logit_bias values to [-100, 100]
MAX_LOGIT_BIAS_TOKENS = 300  # OpenAI's cap on logit_bias entries; the sampler's fixed bias width


def _check_structured_outputs(value) -> None:
    if value is not None and not isinstance(value, StructuredOutputsParams):
        raise ValueError(f"structured_outputs must be a StructuredOutputsParams or None, got {value!r}")


class RequestOutputKind(enum.Enum):
    """Which outputs a request produces (vLLM's RequestOutputKind)."""

    CUMULATIVE = 0  # after every step, everything generated so far
    DELTA = 1  # after every step, only what is new since the previous output
    FINAL_ONLY = 2  # one output, when the request finishes: no per-step outputs, text decoded once at the end


@dataclass(slots=True)
class StructuredOutputsParams:
    """A constraint on a request's output text (vLLM's StructuredOutputsParams): exactly one field is set.

    `json` is a JSON schema (a dict or its JSON text), `regex` a regular expression the whole output matches,
    `choice` the outputs allowed, `grammar` a Lark (or GBNF) grammar, `json_object` any JSON object. Only the form
    is checked here; whether a schema, regex or grammar compiles is jpaged.structured's to say."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            names = ", ".join(f.name for f in fields(self))
            raise ValueError(f"structured_outputs must set exactly one of {names}; got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except ValueError as err:
                raise ValueError(f"json is not valid JSON: {err}") from None
            if not isinstance(parsed, dict):
                raise ValueError(f"json must be a JSON schema object, got {self.json!r}")
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"json must be a JSON schema (a dict or its JSON text), got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"json_object must be true when given, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        """The field that is set: json, regex, choice, grammar or json_object."""
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    def key(self) -> tuple[str, str]:
        """A hashable identity of the constraint (equal schemas written in another key order are equal)."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            value = json.loads(value)
        return self.kind, json.dumps(value, sort_keys=True)


@dataclass(slots=True)
class SamplingParams:
    """How to pick the tokens of one request (vLLM's SamplingParams subset)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None  # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int]
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: until the context is full (the engine knows max_model_len)
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding (jpaged.structured)

    def __post_init__(self) -> None:
        self._check_types()
        if self.seed == -1:  # vLLM and OpenAI clients use -1 for "no seed"
            self.seed = None
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))
        self.bad_words = list(dict.fromkeys(self.bad_words or []))
        if self.logit_bias is not None:
            self.logit_bias = {
                int(token_id): min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(bias)))
                for token_id, bias in self.logit_bias.items()
            }
            if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
                raise ValueError(
                    f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS_TOKENS} are allowed "
                    "(ban or allow many tokens with bad_words or allowed_token_ids)"
                )
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
        self._check_ranges()
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if self.is_greedy:  # truncation cannot change an argmax; turning it off keeps the batch lean
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def stop_strings(self) -> list[str]:
        """`stop` after normalisation (typed as a list for callers)."""
        assert isinstance(self.stop, list)
        return self.stop

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def check_for_vocab(self, vocab_size: int) -> None:
        """Reject token ids the model cannot produce; called by the engine once the vocabulary is known."""
        for name in ("stop_token_ids", "allowed_token_ids"):
            bad = [t for t in getattr(self, name) or [] if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} contains ids outside the vocabulary [0, {vocab_size}): {bad}")
        bad = [t for t in self.logit_bias or {} if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"logit_bias has token ids outside the vocabulary [0, {vocab_size}): {bad}")

    def _check_types(self) -> None:
        for name in ("n", "top_k", "min_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int, got {value!r}")
        for name in ("max_tokens", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an int or None, got {value!r}")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        for name in ("stop_token_ids", "allowed_token_ids"):
            value = getattr(self, name)
            if value is not None and not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                raise ValueError(f"{name} must contain only ints, got {value!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        _check_structured_outputs(self.structured_outputs)
        if self.logit_bias is not None:
            try:
                {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError):
                raise ValueError(
                    f"logit_bias must map token ids to numbers, got {self.logit_bias!r}"
                ) from None

    def _check_ranges(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 or None, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] or None, got {value}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError(f"stop must contain only non-empty strings, got {self.stop!r}")
        if self.stop_strings and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")
        if any(not isinstance(w, str) or not w for w in self.bad_words or []):
            raise ValueError(f"bad_words must contain only non-empty strings, got {self.bad_words!r}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if self.is_greedy and self.n > 1:
            raise ValueError(f"n must be 1 when temperature is 0 (greedy), got {self.n}")


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """A beam search request (vLLM's BeamSearchParams subset); the search itself is deterministic. Under
    `structured_outputs` every beam follows the grammar (transformers' constrained beam search): a beam's
    proposals are its best allowed tokens, and a beam ends on the EOS its complete grammar allows."""

    beam_width: int
    max_tokens: int = 16
    length_penalty: float = 1.0
    ignore_eos: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        penalty = self.length_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(penalty):
            raise ValueError(f"length_penalty must be a finite number, got {penalty!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        _check_structured_outputs(self.structured_outputs)
        if self.structured_outputs is not None and self.ignore_eos:
            raise ValueError(
                "ignore_eos cannot be combined with structured_outputs in a beam search: a beam whose grammar "
                "is complete ends on the EOS"
            )
