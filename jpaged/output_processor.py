"""After each step: append sampled tokens, record logprobs, detokenise, apply vLLM's stop rules, build outputs."""

from __future__ import annotations

import time
from collections.abc import Sequence

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
            seq.logprobs.append(self._logprobs_entry(result, row, params.logprobs))
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

    def _logprobs_entry(self, result: SamplerOutput, row: int, num_top: int) -> dict[int, Logprob]:
        ids = [int(t) for t in result.logprob_token_ids[row, : 1 + num_top]]
        values = [float(v) for v in result.logprobs[row, : 1 + num_top]]
        entry = {ids[0]: Logprob(values[0], int(result.sampled_rank[row]), self.tokenizer.decode([ids[0]]))}
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
        metrics = {"arrival_time": request.arrival_time}
        if request.first_token_time:
            metrics["first_token_time"] = request.first_token_time
            metrics["last_token_time"] = request.last_token_time
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=outputs,
            finished=request.finished or all(o.finish_reason is not None for o in outputs),
            num_cached_tokens=request.num_cached_tokens,
            metrics=metrics,
        )
