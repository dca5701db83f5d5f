"""After each step: append sampled tokens, record logprobs, detokenise, apply vLLM's stop rules, build outputs."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from jpaged.detokenizer import IncrementalDetokenizer
from jpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jpaged.sampler import SamplerOutput
from jpaged.sequence import Request
from jpaged.sequence import Sequence as Seq


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: Sequence[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def attach(self, seq: Seq) -> None:
        """Give a new sequence its detokeniser (a fork continues from a copy of its parent's)."""
        params = seq.request.params
        if params.detokenize:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.request.prompt_token_ids, params)
            if seq.output_token_ids:
                seq.text = seq.detokenizer.add_tokens(seq.output_token_ids)

    def append_token(self, seq: Seq, result: SamplerOutput, row: int) -> None:
        token = int(result.token_ids[row])
        seq.token_ids.append(token)
        params, request = seq.request.params, seq.request
        now = time.time()
        request.first_token_time = request.first_token_time or now
        request.last_token_time = now
        if result.logprobs is not None and params.logprobs is not None:
            seq.logprobs.append(
                self._logprobs_entry(
                    result.logprob_token_ids[row],
                    result.logprobs[row],
                    result.sampled_rank[row],
                    params.logprobs,
                )
            )
            seq.cumulative_logprob += float(result.logprobs[row, 0])
        if seq.detokenizer is not None:
            seq.text += seq.detokenizer.add_tokens([token])
        num_output = len(seq.output_token_ids)
        if num_output >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                seq.finish_reason = "stop"
            elif token in (params.stop_token_ids or ()):
                seq.finish_reason, seq.stop_reason = "stop", token
            elif seq.detokenizer is not None and seq.detokenizer.stop_reason is not None:
                seq.finish_reason, seq.stop_reason = "stop", seq.detokenizer.stop_reason
        if seq.finish_reason is None and (
            num_output >= params.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            seq.finish_reason = "length"
        if seq.finish_reason is not None and seq.detokenizer is not None:
            seq.text += seq.detokenizer.finish()

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
        outputs = [
            CompletionOutput(
                index=seq.index,
                text=seq.text,
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if request.params.logprobs is not None else None,
                logprobs=list(seq.logprobs) if request.params.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for seq in request.seqs
        ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=outputs,
            finished=request.finished or all(o.finish_reason is not None for o in outputs),
            prompt_logprobs=None if request.prompt_logprobs is None else list(request.prompt_logprobs),
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
