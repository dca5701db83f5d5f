"""The engine's side of beam search: checking a search fits, keeping its beams in lockstep, and applying each of
its decisions to the sequences (forks share blocks copy-on-write; beams nobody continues are freed at once).

BeamSearch (beam_search.py) only decides; this module owns what the decision does to the engine's sequences,
through the three engine operations it is given.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

from jpaged.config import EngineConfig
from jpaged.core.beam_search import BeamSearch
from jpaged.core.sequence import Request, SequenceState, SequenceStatus
from jpaged.engine.constrained_decoding import advance
from jpaged.rounding import cdiv
from jpaged.runner.sampling_inputs import SamplerOutput
from jpaged.sampling_params import BeamSearchParams


class BeamDriver:
    """The unfinished beam searches of an engine (by request id) and the steps that move them."""

    def __init__(
        self,
        config: EngineConfig,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        num_total_blocks: int,
        *,
        fork: Callable[[SequenceState], SequenceState],
        requeue: Callable[[SequenceState], None],
        finish: Callable[[SequenceState], None],
    ) -> None:
        self.config = config
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.num_total_blocks = num_total_blocks
        self._fork, self._requeue, self._finish = fork, requeue, finish
        self.active: set[str] = set()

    def new_search(self, num_prompt_tokens: int, params: BeamSearchParams) -> BeamSearch:
        """A beam search for a prompt of this length, checked against the engine: its beams advance together,
        so all of them must fit in one step and in the block pool at full length at once."""
        self.config.check_fan_out("beam_width", params.beam_width, "the beams advance together")
        search = BeamSearch.start(params, self.eos_token_ids, self.max_model_len - num_prompt_tokens)
        size = self.config.block_size
        per_beam = cdiv(num_prompt_tokens % size + search.max_tokens, size)  # after the shared full blocks
        needed = num_prompt_tokens // size + params.beam_width * per_beam
        if needed > self.num_total_blocks:
            raise ValueError(
                f"beam_width={params.beam_width} beams of {num_prompt_tokens} + {search.max_tokens} tokens may need "
                f"{needed} KV blocks at once, more than the {self.num_total_blocks} of the pool: lower "
                "beam_width or max_tokens"
            )
        return search

    def keep_in_lockstep(
        self, seqs: list[SequenceState], num_new_tokens: list[int]
    ) -> tuple[list[SequenceState], list[int]]:
        """The beams of a request are chosen together, so a beam samples only in a step where all its live
        siblings sample. A split step holds the sampling ones back; when a sibling is out of the running set
        (preempted), the running ones go back to waiting too, so the blocks they hold can bring it back
        (their full blocks stay cached, so the recompute is short)."""
        sampling: dict[Request, list[SequenceState]] = defaultdict(list)
        for seq, num_new in zip(seqs, num_new_tokens, strict=True):
            if seq.request.beam is not None and seq.num_computed_tokens + num_new == seq.num_tokens:
                sampling[seq.request].append(seq)
        dropped: set[int] = set()
        for request, sampling_seqs in sampling.items():
            if len(sampling_seqs) == len(request.seqs):
                continue
            dropped.update(seq.seq_id for seq in sampling_seqs)
            if any(seq.status is not SequenceStatus.RUNNING for seq in request.seqs):
                for seq in request.seqs:
                    if seq.status is SequenceStatus.RUNNING:
                        self._requeue(seq)
                        dropped.add(seq.seq_id)
        kept = [i for i, seq in enumerate(seqs) if seq.seq_id not in dropped]
        return [seqs[i] for i in kept], [num_new_tokens[i] for i in kept]

    def advance(self, targets: list[SequenceState], result: SamplerOutput, now: float) -> dict[str, Request]:
        """Hand each beam search its rows' top candidates (row i of `result` is `targets[i]`'s); returns the
        searches that advanced, by request id."""
        proposals: dict[Request, dict[SequenceState, list[tuple[int, float]]]] = defaultdict(dict)
        for row, seq in enumerate(targets):
            if seq.request.beam is not None and seq.finish_reason is None:  # not aborted while it ran
                k = seq.request.beam.num_candidates
                ids, values = result.logprob_token_ids[row, 1 : 1 + k], result.logprobs[row, 1 : 1 + k]
                proposals[seq.request][seq] = list(zip(ids.tolist(), values.tolist(), strict=True))
        for request, by_seq in proposals.items():
            self._apply(request, [by_seq[seq] for seq in request.seqs], now)
        return {request.request_id: request for request in proposals}

    def _apply(self, request: Request, proposals: list[list[tuple[int, float]]], now: float) -> None:
        """Apply one beam search decision: a beam chosen k times forks k - 1 times (sharing its blocks, copy on
        write, and its grammar's state), each new beam appends its token, and beams nobody continues are freed
        at once."""
        parents = request.beam.step(proposals)
        old, continued = list(request.seqs), set()
        beams = []
        for parent in parents:  # every fork is taken before any token lands
            beams.append(self._fork(old[parent]) if parent in continued else old[parent])
            continued.add(parent)
        for seq, beam in zip(beams, request.beam.beams, strict=True):
            seq.token_ids.append(beam.token_ids[-1])
            advance(seq, beam.token_ids[-1])  # its own grammar (a fork copied its parent's before the token)
        for index, seq in enumerate(old):
            if index not in continued:
                self._finish(seq)
        request.seqs = beams
        request.first_token_time = request.first_token_time or now
        request.last_token_time = now
