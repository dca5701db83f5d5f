"""Speculative decoding in the engine loop: proposals before the schedule, acceptance after the step.

Before a step, each running decode gets up to k proposed tokens from its own tokens (n-gram lookup, or a suffix
tree over them and recently finished requests); the scheduler schedules them after its last token, so one forward
computes the target's distribution after the last token and after each proposal (k + 1 sampled rows, a ragged
query like a prefill chunk's: the step shapes warm-up compiled, nothing new).

Acceptance is rejection sampling for a proposal that is one token, not a distribution (vLLM's treatment of n-gram
and suffix drafts): the target's token is drawn at every position as it would be without speculation, from the
same per-position random stream (sampler.py: a draw depends on the seed and the position only), and a proposal
is accepted while it equals that draw. Accepting d with probability p(d) and otherwise drawing from p without d is
exactly what that comparison does, so outputs are the target's distribution; for a fixed seed they are the very
tokens the engine generates without speculation. Greedy rows accept the longest prefix equal to the argmax.

A sequence that accepts a of its k proposals appends a + 1 tokens; the KV of the k - a rejected ones stays in
slots past its length, which its next step overwrites (never hashed into the prefix cache: only positions before
the length are). Proposals pause for a sequence while they stop paying (its running acceptance rate below
PAUSE_BELOW), for the whole batch past disable_by_batch_size, and for a few steps after steps where no sequence
had a proposal (backing off as they repeat: a batch that seldom repeats itself keeps async scheduling's overlap).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from jpaged.config import EngineConfig, SpeculativeConfig
from jpaged.core.ngram_proposer import propose_ngram
from jpaged.core.sequence import SequenceState
from jpaged.core.suffix_proposer import SuffixProposer
from jpaged.engine.scheduled_step import SampledRows
from jpaged.runner.sampling_inputs import SamplerOutput

# A sequence's acceptance rate is a running average over its verifications (this weight on the newest); below
# PAUSE_BELOW its proposals pause for PAUSE_STEPS steps, then it is tried again.
ACCEPTANCE_WEIGHT = 0.25
PAUSE_BELOW = 0.1
PAUSE_STEPS = 8
# After steps where no running sequence had a proposal, steps run without trying (with async scheduling, overlapped:
# proposing needs each sequence's latest token on the host, which waits for the step in flight): none after one
# such step, then 1, 3, 7 as they repeat, at most MAX_IDLE_STEPS, so a copying batch that misses once loses
# nothing while one that seldom repeats itself keeps most of the overlap.
MAX_IDLE_STEPS = 7


@dataclass(slots=True)
class SpecDecodeStats:
    """vLLM's spec_decode counters: verifications with proposals, proposed tokens, accepted tokens, and accepted
    tokens by position (how often the j-th proposal was accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def counters(self) -> dict[str, int]:
        """The scalar counters by vLLM's metric names (less its vllm: prefix)."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
        }

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class Speculation:
    """One engine's proposer and its counters (see the module doc)."""

    def __init__(
        self,
        spec: SpeculativeConfig,
        config: EngineConfig,
        batch_proposer: Callable[[list[tuple[SequenceState, int]]], list[list[int]]] | None = None,
    ) -> None:
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self._max_rows = config.max_num_seqs
        self._max_tokens = config.max_num_batched_tokens
        self._suffix = _suffix_proposer(spec) if spec.method == "suffix" else None
        # What proposes for every sequence at once ([(seq, k)] -> tokens each; a draft model's), else for one
        # (seq, up to k) -> tokens: the method's; a caller may set its own (tests, research code).
        self.batch_proposer = batch_proposer
        self.proposer: Callable[[SequenceState, int], list[int]] = (
            self._ngram if self._suffix is None else self._suffix_tree
        )
        self.stats = SpecDecodeStats(accepted_per_position=[0] * self.k)
        self._idle = 0  # steps left without trying, after one that proposed nothing
        self._misses = 0  # consecutive tries that proposed nothing
        self._backs_off = bool(config.async_scheduling)  # without overlap, trying costs nothing

    def active(self, running: list[SequenceState]) -> bool:
        """Whether the next step tries proposals: not past disable_by_batch_size, nor just after a step where
        none was found."""
        limit = self.spec.disable_by_batch_size
        return bool(running) and (limit is None or len(running) < limit) and not self._idle

    def propose(self, running: list[SequenceState]) -> None:
        """Give each running decode its proposals for the next step, as many as fit the step's rows and tokens
        beside one of each running sequence, and none that would run past its length limit."""
        for seq in running:
            if seq.draft_token_ids:
                seq.draft_token_ids = []
        if not self.active(running):
            self._idle = max(self._idle - 1, 0)
            return
        rows_left = self._max_rows - sum(seq.fan_out for seq in running)
        tokens_left = self._max_tokens - len(running)
        proposed = False
        wanted: list[tuple[SequenceState, int]] = []
        for seq in running:
            if rows_left <= 0 or tokens_left <= 0:
                break
            if not _proposes(seq):
                continue
            if seq.draft_pause:
                seq.draft_pause -= 1
                continue
            k = min(self.k, rows_left, tokens_left, seq.max_num_tokens - seq.num_tokens - 1)
            if k <= 0:
                continue
            if self.batch_proposer is not None:  # proposes k for every sequence asked, all at once below
                wanted.append((seq, k))
                rows_left -= k
                tokens_left -= k
                continue
            drafts = self.proposer(seq, k)[:k]
            seq.draft_token_ids = drafts
            rows_left -= len(drafts)
            tokens_left -= len(drafts)
            proposed = proposed or bool(drafts)
        if wanted:
            for (seq, k), drafts in zip(wanted, self.batch_proposer(wanted), strict=True):
                seq.draft_token_ids = drafts[:k]
                proposed = proposed or bool(drafts)
        self._misses = 0 if proposed else self._misses + 1
        if self._backs_off and self._misses:
            self._idle = min(2 ** (self._misses - 1) - 1, MAX_IDLE_STEPS)

    def _ngram(self, seq: SequenceState, k: int) -> list[int]:
        return propose_ngram(seq.token_ids, k, self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)

    def _suffix_tree(self, seq: SequenceState, k: int) -> list[int]:
        return self._suffix.propose(_key(seq), seq.token_ids, seq.num_prompt_tokens, k)

    def accept(self, rows: SampledRows, sampled: SamplerOutput) -> tuple[SampledRows, SamplerOutput]:
        """The rows whose tokens a verifying step keeps: each sequence's row after its last token, then for each
        proposal equal to the token drawn before it, the row after that proposal. Each verifying sequence's
        computed tokens drop by its rejected proposals (the engine clears its proposals once it has hashed its
        full blocks)."""
        positions, seqs = rows.draft_positions, rows.seqs
        tokens = sampled.token_ids
        stats = self.stats
        keep: list[int] = []
        kept_positions: list[int] = []
        for row, seq in enumerate(seqs):
            if positions[row]:
                continue  # a proposal's row: kept below, with the row before its proposals
            keep.append(row)
            kept_positions.append(0)
            drafts = seq.draft_token_ids
            if not drafts:
                continue
            accepted = 0
            while accepted < len(drafts) and tokens[row + accepted] == drafts[accepted]:
                stats.accepted_per_position[accepted] += 1
                accepted += 1
                keep.append(row + accepted)
                kept_positions.append(accepted)
            stats.num_drafts += 1
            stats.num_draft_tokens += len(drafts)
            stats.num_accepted_tokens += accepted
            seq.num_computed_tokens -= len(drafts) - accepted
            self._observe(seq, accepted / len(drafts))
        index = np.asarray(keep, np.intp)
        kept_seqs = [seqs[row] for row in keep]
        kept = SampledRows(kept_seqs, rows.all_static, rows.all_plain, kept_positions)
        return kept, SamplerOutput(*(np.asarray(array)[index] for array in sampled))

    @staticmethod
    def _observe(seq: SequenceState, rate: float) -> None:
        seq.draft_acceptance += ACCEPTANCE_WEIGHT * (rate - seq.draft_acceptance)
        if seq.draft_acceptance < PAUSE_BELOW:
            seq.draft_pause = PAUSE_STEPS
            seq.draft_acceptance = PAUSE_BELOW  # tried again after the pause, not written off for good

    def forget_finished(self) -> None:
        """Drop what finished requests taught the proposer (the suffix tree of their outputs): a benchmark's rounds
        start equal."""
        if self._suffix is not None:  # live sequences' trees are rebuilt on their next proposal
            self._suffix = _suffix_proposer(self.spec)

    def finished(self, seq: SequenceState, *, aborted: bool = False) -> None:
        """A sequence ended: a finished one's output joins the suffix tree of recent requests."""
        seq.draft_token_ids = []
        if self._suffix is not None:
            key = _key(seq)
            if aborted:
                self._suffix.drop(key)
            else:
                self._suffix.propose(key, seq.token_ids, seq.num_prompt_tokens, 0)  # its last tokens too
                self._suffix.finish(key)


def _proposes(seq: SequenceState) -> bool:
    """Whether a running sequence takes proposals: a decode past its first token (whose step may fan out) whose
    last token is on the host (not pending on an async step), and not a beam."""
    return (
        not seq.num_pending
        and seq.num_computed_tokens == len(seq.token_ids) - 1
        and len(seq.token_ids) > seq.num_prompt_tokens
        and seq.request.beam is None
    )


def _suffix_proposer(spec: SpeculativeConfig) -> SuffixProposer:
    return SuffixProposer(
        spec.suffix_decoding_max_tree_depth,
        spec.suffix_decoding_max_cached_requests,
        spec.suffix_decoding_max_spec_factor,
        spec.suffix_decoding_min_token_prob,
    )


def _key(seq: SequenceState) -> str:
    return str(seq.seq_id)
