"""Structured outputs in the engine loop: each constrained request's grammar compiles in jpaged.structured's
worker while the request waits outside the scheduler (never the batch); once compiled, its sequence gets a
matcher and is scheduled. Every step fills the constrained rows' token bitmasks from their matchers (the
sampler applies them on the device, a fixed-shape input: nothing compiles), and each sampled token advances its
sequence's matcher; a sequence whose grammar is complete stops."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from jpaged.core.sequence import Request, SequenceState
from jpaged.engine.scheduled_step import SampledRows

if TYPE_CHECKING:
    from jpaged.sampling_params import StructuredOutputsParams
    from jpaged.structured import GrammarCompiler, GrammarFuture


class ConstrainedDecoding:
    """Grammars for one engine's tokenizer and vocabulary; the compiler starts on the first constrained
    request (llguidance's view of the tokenizer takes a second to build)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self._waiting: dict[str, tuple[SequenceState, GrammarFuture]] = {}  # request id -> its first sequence
        self.fill_seconds = 0.0  # spent filling bitmasks, on the engine loop before each constrained step

    def _compiler(self) -> GrammarCompiler:
        from jpaged.structured import shared_compiler

        return shared_compiler(self._tokenizer, self.vocab_size, self._eos_token_ids or None)

    def compile(self, spec: StructuredOutputsParams) -> None:
        """Compile now (the cache keeps it for the request): ValueError naming the problem if it does not."""
        self._compiler().compile(spec)

    def hold(self, seq: SequenceState) -> None:
        """Start compiling the sequence's grammar; it waits here until `ready` hands it on."""
        request = seq.request
        self._waiting[request.request_id] = (seq, self._compiler().submit(request.params.structured_outputs))

    def discard(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def ready(self) -> tuple[list[SequenceState], list[tuple[Request, str]]]:
        """Sequences whose grammar compiled (each with its matcher, to schedule now), and requests whose grammar
        failed, with why."""
        done, failed = [], []
        for request_id, (seq, future) in list(self._waiting.items()):
            if not future.ready():
                continue
            del self._waiting[request_id]
            try:
                seq.grammar = future.result().matcher()
            except ValueError as err:
                failed.append((seq.request, str(err)))
                continue
            done.append(seq)
        return done, failed

    def wait(self, timeout: float) -> None:
        """Block until some waiting grammar compiles, or `timeout` seconds (for a loop with nothing else to do)."""
        futures = [future.future for _, future in self._waiting.values()]
        if futures:
            concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def bitmasks(self, rows: SampledRows) -> list[np.ndarray | None]:
        """Each row's allowed tokens now (int32 words; None for an unconstrained row), filled in parallel. A row
        after proposed tokens gets its grammar's mask after them (each taken, then rolled back)."""
        from jpaged.structured import allocate_bitmask, fill_bitmasks

        row_seqs = rows.seqs
        first_row: dict[int, int] = {}  # a sequence's first row: the rows of its n samples share its matcher
        for i, seq in enumerate(row_seqs):
            if seq.grammar is not None:
                first_row.setdefault(id(seq), i)
        if not first_row:
            return [None] * len(row_seqs)
        start = time.perf_counter()
        masks = allocate_bitmask(len(row_seqs), self.vocab_size)
        fill_bitmasks([(row_seqs[i].grammar, i) for i in first_row.values()], masks)
        positions = rows.draft_positions
        if positions is not None:
            for i in first_row.values():
                _fill_after_proposals(row_seqs[i], masks[i : i + len(row_seqs[i].draft_token_ids) + 1])
        self.fill_seconds += time.perf_counter() - start
        return [
            masks[first_row[id(seq)] + (positions[row] if positions else 0)]
            if seq.grammar is not None
            else None
            for row, seq in enumerate(row_seqs)
        ]


def _fill_after_proposals(seq: SequenceState, masks: np.ndarray) -> None:
    """masks[j] for the rows after the sequence's first j proposals (masks[0] is filled): its grammar takes them
    in turn and is rolled back. Past a proposal the grammar refuses, the rows keep the mask before it: the target
    cannot draw that proposal there, so it is rejected and the rows after it go unread."""
    grammar, taken = seq.grammar, 0
    for j, token in enumerate(seq.draft_token_ids, start=1):
        allowed = (masks[j - 1][token >> 5] >> (token & 31)) & 1
        if taken == j - 1 and allowed and grammar.accept_token(token):
            taken = j
            grammar.fill_bitmask(masks[j])
        else:
            masks[j] = masks[j - 1]
    grammar.rollback(taken)


def advance(seq: SequenceState, token: int) -> bool:
    """Feed the sampled token to the sequence's matcher; True when the grammar is now complete."""
    grammar = seq.grammar
    if grammar is None:
        return False
    grammar.accept_token(token)
    return grammar.is_terminated()
