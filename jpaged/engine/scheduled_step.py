"""One step as the engine hands it on: the scheduled sequences, the rows they sample, and the plain schedule the
runner pads (runner.step_batch.StepSchedule), gathered in one pass over the scheduler's plan; then, launched, the
step in flight until its tokens are processed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from jpaged.core.sequence import SequenceState
from jpaged.runner.step_batch import PreparedStep, StepSchedule

if TYPE_CHECKING:
    from jpaged.runner.step_output import PendingOutput


@dataclass(slots=True)
class SampledRows:
    """The sequence of every sampled row (a request's first token fans out to n rows, all its sequence's), and
    whether every row has static sampling inputs, and is plain greedy (see Request).

    A sequence verifying k proposed tokens samples k + 1 consecutive rows, one a position from its last token on:
    `draft_positions` holds each row's (0 for every other row), None in a step with no proposals."""

    seqs: list[SequenceState] = field(default_factory=list)
    all_static: bool = True
    all_plain: bool = True
    draft_positions: list[int] | None = None

    def forks(self, row: int) -> bool:
        """Whether this row is an extra sample of the row before's sequence (a fan-out), not a proposal's."""
        if not row or self.seqs[row - 1] is not self.seqs[row]:
            return False
        return self.draft_positions is None or not self.draft_positions[row]


@dataclass(slots=True)
class ScheduledStep:
    seqs: list[SequenceState]  # seqs[i] computes num_new_tokens[i] tokens from its num_computed_tokens on
    num_new_tokens: list[int]
    rows: SampledRows
    prompt_logprob_seqs: list[int]  # scheduled indices that compute prompt logprobs this step
    schedule: StepSchedule
    num_first_prompt_tokens: int  # prompt tokens of the requests getting their first token


def scheduled_step(
    seqs: list[SequenceState],
    num_new_tokens: list[int],
    block_tables: np.ndarray,
    lora_slot_of: Callable[[int], int] | None = None,
) -> ScheduledStep:
    """The step of these scheduled sequences (block table of seqs[i] in row i of `block_tables`); with
    `lora_slot_of` (an adapter id's device slot), each one's LoRA slot."""
    row_seqs: list[SequenceState] = []
    sample_rows: list[int] = []
    prompt_logprob_seqs: list[int] = []
    all_static = all_plain = True
    num_first_prompt_tokens = 0
    token_ids = [seq.token_ids for seq in seqs]
    draft_positions: list[int] | None = None
    sample_back: list[int] = []
    for i, seq in enumerate(seqs):  # every running sequence, every step: kept lean
        request = seq.request
        if request.prompt_logprobs is not None and computes_prompt_logprobs(seq):
            prompt_logprob_seqs.append(i)
        num_tokens = seq.num_tokens
        drafts = seq.draft_token_ids
        if drafts:  # scheduled with its proposals (the scheduler drops those it has no room for): it samples
            # after its last token and after each proposal, k + 1 rows
            if draft_positions is None:
                draft_positions = [0] * len(sample_rows)
                sample_back = [0] * len(sample_rows)
            token_ids[i] = seq.token_ids + drafts
            all_static = all_static and request.static_sampling
            all_plain = all_plain and request.plain_greedy
            for position in range(len(drafts) + 1):
                sample_rows.append(i)
                row_seqs.append(seq)
                draft_positions.append(position)
                sample_back.append(len(drafts) - position)
            continue
        if seq.num_computed_tokens + num_new_tokens[i] != num_tokens:
            continue  # a prefill chunk short of the prompt's end samples nothing
        all_static = all_static and request.static_sampling
        all_plain = all_plain and request.plain_greedy
        sample_rows.append(i)
        row_seqs.append(seq)
        if draft_positions is not None:
            draft_positions.append(0)
            sample_back.append(0)
        if num_tokens == len(request.prompt_token_ids):  # first token: n samples, or a beam's proposals
            if seq.index == 0:
                num_first_prompt_tokens += num_tokens
            for _ in range(1, seq.num_sample_rows):
                sample_rows.append(i)
                row_seqs.append(seq)
                if draft_positions is not None:
                    draft_positions.append(0)
                    sample_back.append(0)
    rows = SampledRows(row_seqs, all_static, all_plain, draft_positions)
    schedule = StepSchedule(
        token_ids,
        [seq.num_computed_tokens for seq in seqs],
        num_new_tokens,
        block_tables,
        sample_rows,
        [seq.pending_row for seq in seqs],
        [(i, seqs[i].request.prompt_token_ids) for i in prompt_logprob_seqs],
        [seq.num_prompt_tokens for seq in seqs],
        None if lora_slot_of is None else [lora_slot_of(seq.request.lora_int_id) for seq in seqs],
        None if draft_positions is None else sample_back,
    )
    return ScheduledStep(seqs, num_new_tokens, rows, prompt_logprob_seqs, schedule, num_first_prompt_tokens)


def computes_prompt_logprobs(seq: SequenceState) -> bool:
    """Whether this sequence still has prompt positions whose logprobs are owed (its request asked for them)."""
    return (
        seq.request.prompt_logprobs is not None
        and seq.index == 0
        and seq.num_computed_tokens < seq.num_prompt_tokens - 1
    )


@dataclass(slots=True)
class InFlightStep:
    """A step on the device whose tokens the host has not processed yet."""

    scheduled: ScheduledStep
    prepared: PreparedStep
    output: PendingOutput
    needs_results: bool  # the next schedule must see its tokens first (see LLMEngine.step)
