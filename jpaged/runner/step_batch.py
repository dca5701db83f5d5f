"""From a plain schedule to the padded batch the device step takes (host side, numpy only).

This is the boundary between the engine and the device: `StepSchedule` says what runs, in plain lists and arrays
(no host-core objects); `pad_batch` pads it to its shape bucket as a `StepBatch` (models.llama), padding tokens
writing to the null block 0 and padding rows sampling nothing anyone reads.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from jpaged.models.batch import StepBatch
from jpaged.runner.step_shapes import StepShapes


@dataclass(slots=True)
class StepSchedule:
    """One step's work: scheduled sequence i computes `num_new_tokens[i]` of its `token_ids[i]` (prompt then
    output) from `num_computed[i]` on, through row i of `block_tables` [S', W] (padded with the null block 0).

    A sequence whose last token is still on the device (async scheduling) has `pending_rows[i]` >= 0: its last
    input is the token the previous step sampled in that row, and `token_ids[i]` lacks it."""

    token_ids: list[list[int]]
    num_computed: list[int]
    num_new_tokens: list[int]
    block_tables: np.ndarray
    sample_rows: list[int]  # the scheduled index of each sampled row (a first token fans out to n rows)
    pending_rows: list[int]
    # Sequences that compute prompt logprobs: (scheduled index, its prompt's token ids).
    prompt_logprob_seqs: list[tuple[int, Sequence[int]]] = field(default_factory=list)
    # Each sequence's prompt length, for the RoPE scalings that depend on it (StepBatch.rope_lengths); None: every
    # token is prompt (a pooling step).
    prompt_lens: list[int] | None = None
    # Each sequence's LoRA slot (0: the base model) where the engine serves adapters; None where it serves none.
    lora_slots: list[int] | None = None
    # For each sampled row, how many tokens before its sequence's last scheduled one it samples after (a sequence
    # verifying k proposed tokens samples after each of its last k + 1); None: every row samples after the last.
    sample_back: list[int] | None = None


@dataclass(slots=True)
class PreparedStep:
    """A schedule as padded device inputs. With prompt logprobs, `prompt_targets` [T] holds each token's next
    prompt token (the target of its logprob), for the prompt-logprobs program after the step."""

    batch: StepBatch
    prompt_targets: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        """Rows the sampler takes: the sequence bucket S."""
        return self.batch.kv_lens.shape[0]


def pad_batch(schedule: StepSchedule, shapes: StepShapes, block_size: int, table_width: int) -> PreparedStep:
    """The schedule padded to its (T, S) bucket, block tables to `table_width` columns."""
    num_new_tokens, computed_counts = schedule.num_new_tokens, schedule.num_computed
    num_seqs, sample_rows = len(num_new_tokens), schedule.sample_rows
    num_new = np.array(num_new_tokens, np.int32)
    computed = np.array(computed_counts, np.int32)
    num_tokens = sum(num_new_tokens)
    t_bucket, s_bucket = shapes.shape_for(num_tokens, max(num_seqs, len(sample_rows)))
    query_start = np.full(s_bucket + 1, num_tokens, np.int32)
    query_start[0] = 0
    np.cumsum(num_new, out=query_start[1 : num_seqs + 1])
    token_ids = np.zeros(t_bucket, np.int32)
    positions = np.zeros(t_bucket, np.int32)
    if num_tokens == num_seqs and max(num_new_tokens, default=0) == 1:  # decodes only: one token each
        seq_of_token = np.arange(num_seqs)
        positions[:num_tokens] = computed
        token_ids[:num_tokens] = [
            ids[c] if r < 0 else -1 - r
            for ids, c, r in zip(schedule.token_ids, computed_counts, schedule.pending_rows, strict=True)
        ]
    else:
        seq_of_token = np.repeat(np.arange(num_seqs), num_new)
        positions[:num_tokens] = np.arange(num_tokens) - query_start[seq_of_token] + computed[seq_of_token]
        chunks = (
            ids[c : c + n] if r < 0 else [*ids[c : c + n - 1], -1 - r]
            for ids, c, n, r in zip(
                schedule.token_ids, computed_counts, num_new_tokens, schedule.pending_rows, strict=True
            )
        )
        token_ids[:num_tokens] = np.fromiter(itertools.chain.from_iterable(chunks), np.int32, num_tokens)
    tables = np.zeros((s_bucket, table_width), np.int32)
    width = min(schedule.block_tables.shape[1], table_width)  # columns past the table width are padding
    tables[:num_seqs, :width] = schedule.block_tables[:, :width]
    slot_mapping = np.zeros(t_bucket, np.int32)
    live = positions[:num_tokens]
    slot_mapping[:num_tokens] = tables[seq_of_token, live // block_size] * block_size + live % block_size
    kv_lens = np.zeros(s_bucket, np.int32)
    kv_lens[:num_seqs] = computed + num_new
    prompt_lens = schedule.prompt_lens or [len(ids) for ids in schedule.token_ids]
    rope_lengths = np.zeros(t_bucket, np.int32)  # padding: 0, the short/original frequencies
    rope_lengths[:num_tokens] = np.maximum(np.asarray(prompt_lens, np.int32)[seq_of_token], live + 1)
    lora_slots = None
    if schedule.lora_slots is not None:
        lora_slots = np.zeros(t_bucket, np.int32)  # padding: no adapter
        lora_slots[:num_tokens] = np.asarray(schedule.lora_slots, np.int32)[seq_of_token]
    logits_indices = np.zeros(s_bucket, np.int32)
    logits_indices[: len(sample_rows)] = query_start[np.asarray(sample_rows, np.int32) + 1] - 1
    if schedule.sample_back is not None:
        logits_indices[: len(sample_rows)] -= np.asarray(schedule.sample_back, np.int32)
    num_logits = len(sample_rows)
    prompt_targets = None
    if schedule.prompt_logprob_seqs:
        prompt_targets = np.zeros(t_bucket, np.int32)
        for i, prompt in schedule.prompt_logprob_seqs:
            start, first = query_start[i], computed[i]
            # Tokens at positions first .. len(prompt) - 2 have a next prompt token; the last one has none.
            count = max(0, min(int(num_new[i]), len(prompt) - 1 - first))
            prompt_targets[start : start + count] = prompt[first + 1 : first + 1 + count]
    batch = StepBatch(
        token_ids,
        positions,
        slot_mapping,
        tables,
        query_start,
        kv_lens,
        np.array([num_seqs], np.int32),
        logits_indices,
        np.array([num_logits], np.int32),
        rope_lengths,
        lora_slots,
    )
    return PreparedStep(batch, prompt_targets)


def dummy_batch(num_tokens: int, num_seqs: int, table_width: int, lora: bool = False) -> StepBatch:
    """A batch of these shapes with no live sequence: every token writes to the null block 0 (with `lora`, each
    token's adapter slot 0)."""
    zeros = functools.partial(np.zeros, dtype=np.int32)
    return StepBatch(
        zeros(num_tokens),
        zeros(num_tokens),
        zeros(num_tokens),
        zeros((num_seqs, table_width)),
        zeros(num_seqs + 1),
        zeros(num_seqs),
        np.array([0], np.int32),
        zeros(num_seqs),
        np.array([0], np.int32),
        zeros(num_tokens),
        zeros(num_tokens) if lora else None,
    )
