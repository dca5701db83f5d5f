"""After each step: append sampled tokens, record logprobs, detokenise, apply vLLM's stop rules, build outputs.

Outputs follow the request's `output_kind` (vLLM's RequestOutputKind): CUMULATIVE and DELTA produce one
RequestOutput per step, FINAL_ONLY one at the end. A FINAL_ONLY request without stop strings has nobody reading
its text before it finishes, so it is decoded once then (`decode_output`), not token by token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jpaged.core.sequence import Request, SequenceState
from jpaged.engine.constrained_decoding import advance
from jpaged.engine.detokenizer import IncrementalDetokenizer, decode_output
from jpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jpaged.runner.sampling_inputs import SamplerOutput
from jpaged.sampling_params import RequestOutputKind


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: Sequence[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def attach(self, seq: SequenceState) -> None:
        """Give a new sequence its incremental detokeniser when its text is read (streamed, or searched for stop
        strings) before it finishes; a fork continues from a fresh one fed its parent's tokens."""
        params = seq.request.params
        if params.detokenize and (params.stop or params.output_kind is not RequestOutputKind.FINAL_ONLY):
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.request.prompt_token_ids, params)
            if len(seq.token_ids) > seq.num_prompt_tokens:
                seq.text = seq.detokenizer.add_tokens(seq.output_token_ids)

    def append_tokens(
        self,
        seqs: Sequence[SequenceState],
        tokens: Sequence[int],
        now: float,
        result: SamplerOutput | None = None,
    ) -> list[SequenceState]:
        """Append row i's token to seqs[i] and apply the stop rules; returns the sequences that finished.

        Rows of beam searches are skipped (their tokens are the search's to place), and so are rows of sequences
        that ended while the step ran (async scheduling: finished the step before, or aborted). `result`
        supplies logprobs where asked; `now` is the step's clock reading. One call per step, as its loop runs
        for every token."""
        finished = []
        eos_token_ids, max_model_len = self.eos_token_ids, self.max_model_len
        with_logprobs = result is not None and result.logprobs is not None
        for row, seq in enumerate(seqs):
            request = seq.request
            if request.beam is not None or seq.finish_reason is not None:
                continue
            token = tokens[row]
            token_ids = seq.token_ids
            token_ids.append(token)
            if seq.num_pending:  # the token the next step was scheduled without
                seq.num_pending -= 1
                if not seq.num_pending:
                    seq.pending_row = -1
            params = request.params
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            if with_logprobs and params.logprobs is not None:
                self._append_logprobs(seq, result, row)
            detokenizer = seq.detokenizer
            if detokenizer is not None:
                seq.text += detokenizer.add_tokens((token,))
            num_tokens = len(token_ids)
            num_output = num_tokens - len(request.prompt_token_ids)
            if advance(seq, token):  # its grammar is complete: nothing but EOS could follow
                seq.finish_reason = "stop"
            elif num_output >= params.min_tokens:
                if token in eos_token_ids and not params.ignore_eos:
                    seq.finish_reason = "stop"
                elif params.stop_token_ids and token in params.stop_token_ids:
                    seq.finish_reason, seq.stop_reason = "stop", token
                elif detokenizer is not None and detokenizer.stop_reason is not None:
                    seq.finish_reason, seq.stop_reason = "stop", detokenizer.stop_reason
            if seq.finish_reason is None and (
                num_tokens >= max_model_len
                or (params.max_tokens is not None and num_output >= params.max_tokens)
            ):
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                self._finish_text(seq)
                finished.append(seq)
        return finished

    def _append_logprobs(self, seq: SequenceState, result: SamplerOutput, row: int) -> None:
        seq.logprobs.append(
            self._logprobs_entry(
                result.logprob_token_ids[row],
                result.logprobs[row],
                result.sampled_rank[row],
                seq.request.params.logprobs,
            )
        )
        seq.cumulative_logprob += float(result.logprobs[row, 0])

    def abort(self, seq: SequenceState) -> None:
        """End a sequence that has not finished with finish_reason 'abort'. Its text is what was streamed: an
        incremental detokeniser keeps what it held back; a deferred one decodes what there is."""
        if seq.finish_reason is None:
            seq.finish_reason = "abort"
            if seq.detokenizer is None:
                self._finish_text(seq)

    def _finish_text(self, seq: SequenceState) -> None:
        params = seq.request.params
        if seq.detokenizer is not None:
            seq.text += seq.detokenizer.finish()
        elif params.detokenize:
            seq.text = decode_output(
                self.tokenizer, seq.request.prompt_token_ids, seq.output_token_ids, params
            )

    def record_prompt_logprobs(
        self,
        request: Request,
        first_position: int,
        num_tokens: int,
        prompt_logprobs: tuple[np.ndarray, np.ndarray, np.ndarray],
        first_row: int,
    ) -> None:
        """Store the logprobs a step computed for prompt tokens: the token at position p (from row
        first_row + p - first_position) yields the entry of prompt token p + 1."""
        values, ids, ranks = prompt_logprobs
        num_top = request.params.prompt_logprobs
        last = min(first_position + num_tokens, len(request.prompt_token_ids) - 1)
        for position in range(first_position, last):
            row = first_row + position - first_position
            request.prompt_logprobs[position + 1] = self._logprobs_entry(
                ids[row], values[row], ranks[row], num_top
            )

    def _logprobs_entry(
        self, ids_row: np.ndarray, values_row: np.ndarray, rank: int, num_top: int
    ) -> dict[int, Logprob]:
        """The chosen token (first in the rows) with its rank, then the top `num_top`."""
        ids = [int(t) for t in ids_row[: 1 + num_top]]
        values = [float(v) for v in values_row[: 1 + num_top]]
        entry = {ids[0]: Logprob(values[0], int(rank), self.tokenizer.decode([ids[0]]))}
        for rank, (token, value) in enumerate(zip(ids[1:], values[1:], strict=True), start=1):
            entry.setdefault(token, Logprob(value, rank, self.tokenizer.decode([token])))
        return entry

    def request_output(self, request: Request) -> RequestOutput:
        """The request's output now: everything so far, or for DELTA what is new since its previous output (the
        sequences with new tokens or just aborted; prompt logprobs in the first output only). Outputs share the
        request's prompt_token_ids list: read it, don't change it."""
        params = request.params
        delta = params.output_kind is RequestOutputKind.DELTA
        with_logprobs = params.logprobs is not None
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is not None:
            sent = delta and any(seq.num_emitted_tokens for seq in request.seqs)
            prompt_logprobs = None if sent else list(prompt_logprobs)
        num_prompt = len(request.prompt_token_ids)
        outputs = []
        finished = True
        for seq in request.seqs:
            finished = finished and seq.finish_reason is not None
            first_token, first_char = num_prompt, 0
            if delta:
                num_tokens = len(seq.token_ids) - num_prompt
                if num_tokens == seq.num_emitted_tokens and seq.finish_reason != "abort":
                    continue
                first_token, first_char = num_prompt + seq.num_emitted_tokens, seq.num_emitted_chars
                seq.num_emitted_tokens, seq.num_emitted_chars = num_tokens, len(seq.text)
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.text[first_char:] if first_char else seq.text,
                    token_ids=seq.token_ids[first_token:],
                    cumulative_logprob=seq.cumulative_logprob if with_logprobs else None,
                    logprobs=seq.logprobs[first_token - num_prompt :] if with_logprobs else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=finished or request.finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=request.num_cached_tokens,
            metrics=_metrics(request),
        )

    def beam_search_output(self, request: Request, *, aborted: bool = False) -> RequestOutput:
        """A beam search's result: its hypotheses, best first (or, when aborted, its live beams)."""
        search = request.beam
        if aborted:
            found = [(b.token_ids, b.cumulative_logprob, "abort") for b in search.beams]
        else:
            found = [
                (h.token_ids, h.cumulative_logprob, "stop" if h.ended_on_eos else "length")
                for h in search.hypotheses
            ]
        outputs = [
            CompletionOutput(
                index=rank,
                text=self.tokenizer.decode(token_ids, skip_special_tokens=True),
                token_ids=list(token_ids),
                cumulative_logprob=cumulative_logprob,
                finish_reason=finish_reason,
            )
            for rank, (token_ids, cumulative_logprob, finish_reason) in enumerate(found)
        ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=outputs,
            finished=True,
            num_cached_tokens=request.num_cached_tokens,
            metrics=_metrics(request),
        )


def _metrics(request: Request) -> dict[str, float]:
    metrics = {"arrival_time": request.arrival_time}
    if request.first_token_time:
        metrics["first_token_time"] = request.first_token_time
        metrics["last_token_time"] = request.last_token_time
    return metrics
