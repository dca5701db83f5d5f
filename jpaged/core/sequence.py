"""Host-side state of requests and their sequences (one per sample: n > 1 and beams fork more)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from jpaged.core.beam_search import BeamSearch
from jpaged.outputs import Logprob
from jpaged.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One user request: a prompt, its sampling params and the sequences generating for it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    seqs: list[SequenceState] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_cached_tokens: int = 0
    beam: BeamSearch | None = None  # set for a beam search; its live beams are `seqs`, in the search's order
    # With prompt_logprobs: None for the first prompt token, then one dict per prompt token once computed.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    bad_words_token_ids: list[list[int]] = field(
        default_factory=list
    )  # from engine.tokenizer.tokenize_bad_words
    # Set by the engine when the request arrives. Static: its sampling inputs stay the same from step to step,
    # but for the step count (nothing depends on its outputs: no penalties, bad words or min_tokens; not a
    # beam). Plain greedy: static and sampled exactly like the sampler's padding rows (greedy, nothing biasing
    # it, no logprobs), so its rows need no sampling inputs of their own.
    static_sampling: bool = False
    plain_greedy: bool = False
    lora_int_id: int = 0  # its LoRA adapter's id (0: the base model)

    @property
    def finished(self) -> bool:
        return all(s.status is SequenceStatus.FINISHED for s in self.seqs)


@dataclass(slots=True, eq=False)
class SequenceState:
    """Token ids (prompt then output) and how many of them are in the KV cache."""

    seq_id: int
    request: Request
    token_ids: list[int]
    index: int = 0  # which of the request's n samples
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    prefix_matched: bool = False  # whether match_prefix ran since the sequence last (re)started
    arrival_order: int = 0  # FCFS tie-break; preemption picks the newest
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    text: str = (
        ""  # output text streamed so far (the detokenizer holds back partial characters, stop prefixes)
    )
    detokenizer: Any = None
    seed: int = 0
    num_emitted_tokens: int = 0  # output tokens (and characters of `text`) already sent in DELTA outputs
    num_emitted_chars: int = 0
    # Async scheduling: tokens sampled by dispatched steps that have not reached `token_ids` yet, and while there
    # are any, the row of the latest such step that samples its newest one (-1 otherwise).
    num_pending: int = 0
    pending_row: int = -1
    holds_lora: bool = False  # whether it holds its adapter's device slot (core/lora_slots.py)
    max_num_tokens: int = 2**62  # where it ends for length (max_tokens, max_model_len), set by the engine
    grammar: Any = None  # structured outputs: its jpaged.structured.GrammarMatcher, set once it compiled
    # Speculative decoding: the tokens proposed to follow its last one, verified by the step that schedules them
    # (the scheduler drops them where the step has no room), and how proposals for it have fared (a running
    # acceptance rate; while it is low, `draft_pause` steps pass before the next proposal).
    draft_token_ids: list[int] = field(default_factory=list)
    draft_acceptance: float = 1.0
    draft_pause: int = 0

    @property
    def num_tokens(self) -> int:
        """Its tokens, the ones still on the device (num_pending) included."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def fan_out(self) -> int:
        """Sequence slots it holds against max_num_seqs: until a request's first token, all the sequences it
        will fork into there (n samples, or beam_width beams); else 1."""
        first = (  # the length test first: it is the one that fails for every decode
            len(self.token_ids) == len(self.request.prompt_token_ids)
            and self.index == 0
            and len(self.request.seqs) == 1
        )
        if not first:
            return 1
        return self.request.params.n if self.request.beam is None else self.request.beam.params.beam_width

    @property
    def num_sample_rows(self) -> int:
        """Rows it samples next: its fan_out, except a beam, which proposes its top-K tokens from one row."""
        return self.fan_out if self.request.beam is None else 1

    @property
    def priority_key(self) -> tuple[int, int]:
        """Lower runs first: the request's priority, then arrival."""
        return (self.request.priority, self.arrival_order)
