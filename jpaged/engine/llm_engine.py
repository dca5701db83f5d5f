"""LLMEngine: requests in, one scheduled device step at a time, RequestOutputs out."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

import numpy as np

from jpaged.config import EngineConfig
from jpaged.core.beam_search import BeamSearch
from jpaged.core.block_manager import BlockManager
from jpaged.core.kv_cache_sizing import (
    check_max_model_len_fits,
    configure_accelerator_allocator,
    determine_num_blocks,
    kv_bytes_per_token,
    startup_summary,
)
from jpaged.core.scheduler import Scheduler
from jpaged.core.sequence import Request, SequenceState
from jpaged.engine.beam_driver import BeamDriver
from jpaged.engine.output_processor import OutputProcessor
from jpaged.engine.step_sampling import (
    StepSampling,
    has_static_sampling,
    is_plain_greedy,
    sample_seed_for,
)
from jpaged.models.loader import LoadedModel, load_model
from jpaged.outputs import RequestOutput
from jpaged.runner.sampler import LOGPROB_BUCKETS, SamplerOutput
from jpaged.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, tokenize_bad_words

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 2048


class LLMEngine:
    """The synchronous engine loop: `add_request`, then `step()` until `has_unfinished()` is False."""

    def __init__(
        self, config: EngineConfig | None = None, *, model: LoadedModel | None = None, **engine_args
    ):
        self.config = config = config or EngineConfig(**engine_args)
        configure_accelerator_allocator(config.gpu_memory_utilization)
        import jax

        platform = jax.default_backend()
        dtype = {"auto": np.float32 if platform == "cpu" else "bfloat16"}.get(config.dtype, config.dtype)
        self.model = model or load_model(config.model, jax.numpy.dtype(dtype))
        self.model_config = mc = self.model.config
        self.tokenizer = self.model.tokenizer
        self.max_model_len = config.max_model_len or min(mc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        bytes_per_token = kv_bytes_per_token(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, jax.numpy.dtype(dtype).itemsize
        )
        stats = jax.devices()[0].memory_stats() if platform != "cpu" else None
        peak = 0
        if stats and config.num_blocks is None:
            from jpaged.runner.model_runner import activation_peak_bytes

            peak = activation_peak_bytes(config, mc, self.model.params, self.max_model_len)
        num_blocks = determine_num_blocks(
            block_size=config.block_size,
            bytes_per_token=bytes_per_token,
            num_blocks=config.num_blocks,
            kv_cache_memory=config.kv_cache_memory,
            device_memory=stats.get("bytes_limit") if stats else None,
            gpu_memory_utilization=config.gpu_memory_utilization,
            weight_bytes=sum(x.nbytes for x in jax.tree_util.tree_leaves(self.model.params)),
            activation_peak_bytes=peak,
        )
        check_max_model_len_fits(num_blocks, config.block_size, self.max_model_len)
        logger.info(startup_summary(num_blocks, config.block_size, bytes_per_token, self.max_model_len))
        num_swap_blocks = int(config.swap_space * 2**30 // (bytes_per_token * config.block_size))
        self.blocks = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching, num_swap_blocks
        )
        self.scheduler = Scheduler(config, self.blocks)
        from jpaged.runner.model_runner import ModelRunner

        self.runner = ModelRunner(config, mc, self.model.params, num_blocks, self.max_model_len)
        self._host_k = self._host_v = None
        if config.preemption_mode == "swap" and num_swap_blocks:
            shape = (mc.num_layers, num_swap_blocks, config.block_size, mc.num_kv_heads, mc.head_dim)
            self._host_k, self._host_v = np.zeros(shape, dtype), np.zeros(shape, dtype)
        self.outputs = OutputProcessor(self.tokenizer, mc.eos_token_ids, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.beams = BeamDriver(
            config,
            mc.eos_token_ids,
            self.max_model_len,
            self.blocks.num_total_blocks,
            fork=self._fork,
            requeue=self._requeue,
            finish=self.scheduler.finish,
        )
        self.sampling = StepSampling(self.runner.sampling_tensors, (mc.eos_token_ids or (None,))[0])
        self._rng = np.random.default_rng(config.seed)
        self._next_seq_id = 0
        self._private_salts = itertools.count()
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0}
        self.warmup_seconds = 0.0 if config.enforce_eager else self.runner.warmup()

    # ---- requests ----

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | BeamSearchParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a request. BeamSearchParams make it a beam search: its output comes once, when it is done."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            text, token_ids = None, [int(t) for t in prompt]
        self.validate_prompt(token_ids)
        beam = None
        if isinstance(params, BeamSearchParams):
            beam = self.new_beam_search(len(token_ids), params)
            params = beam.sampling_params()
        else:
            self.verify_params(params)
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**63))
        if params.prompt_logprobs is not None:
            # Logprobs are needed at every prompt position, so prefix hits from other requests must not skip
            # any (vLLM turns prefix caching off for such requests): a private salt gives its blocks their own
            # hashes, and its own hits after a preemption cover only positions it already computed.
            cache_salt = f"{cache_salt or ''}\0prompt_logprobs:{next(self._private_salts)}"
        request = Request(
            request_id, text, token_ids, params, seed, time.time(), priority, cache_salt, beam=beam
        )
        if params.bad_words:
            request.bad_words_token_ids = tokenize_bad_words(params.bad_words, self.tokenizer)
        request.static_sampling = beam is None and has_static_sampling(params)
        request.plain_greedy = request.static_sampling and is_plain_greedy(params)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(token_ids)
        if beam is not None:
            self.beams.active.add(request_id)
        seq = self._new_seq(request, list(token_ids), index=0)
        self.outputs.attach(seq)
        self.scheduler.add(seq)
        self.requests[request_id] = request
        return request

    def validate_prompt(self, token_ids: Sequence[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: it must hold at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens long, but max_model_len is {self.max_model_len} "
                "(the prompt plus at least one generated token must fit)"
            )
        bad = [t for t in token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.model_config.vocab_size})"
            )

    def verify_params(self, params: SamplingParams) -> None:
        """What sampling params must also satisfy on this engine: ids inside the vocabulary, and n samples that
        fit in one step, since all of them come from the prompt's last step together."""
        params.verify_for_vocab(self.model_config.vocab_size)
        self.config.check_fan_out(
            "n", params.n, "a request's samples are all drawn from its prompt's last step"
        )

    def new_beam_search(self, num_prompt_tokens: int, params: BeamSearchParams) -> BeamSearch:
        """A beam search for a prompt of this length, checked against this engine (see BeamDriver)."""
        return self.beams.new_search(num_prompt_tokens, params)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now: its blocks are freed at once. Returns its final output (finish_reason 'abort')."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.beams.active.discard(request_id)
        for seq in request.seqs:
            self.outputs.abort(seq)
            self.scheduler.finish(seq)
        if request.beam is not None:
            return self.outputs.beam_search_output(request, aborted=True)
        return self.outputs.request_output(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def warm_up_while_idle(self) -> bool:
        """For a loop with no request to step: run one step shape that has not run yet (see
        ModelRunner.warmup), so no later request pays its first run; False once every shape has run."""
        return self.runner.run_unrun_shape()

    # ---- the loop ----

    def step(self) -> list[RequestOutput]:
        """Schedule, run one device step, process its tokens; returns the outputs due this step: every advanced
        request's, except FINAL_ONLY ones (and beam searches) until they finish."""
        plan = self.scheduler.schedule()
        self._run_swaps(plan.swap_out, plan.swap_in)
        seqs, num_new_tokens = plan.seqs, plan.num_new_tokens
        if self.beams.active:
            seqs, num_new_tokens = self.beams.keep_in_lockstep(seqs, num_new_tokens)
        if not seqs:
            self._copy_blocks(plan.copies)
            return []
        rows, row_seqs, prompt_seqs, all_static, all_plain = self._sampled_rows(seqs, num_new_tokens)
        tables = self.blocks.block_tables([seq.seq_id for seq in seqs])
        batch, num_rows, prompt_targets = self.runner.prepare(seqs, num_new_tokens, tables, rows, prompt_seqs)
        tensors, num_logprobs = self.sampling.inputs(row_seqs, num_rows, all_static, all_plain)
        num_prompt_logprobs = None
        if prompt_seqs:
            asked = max(seqs[i].request.params.prompt_logprobs for i in prompt_seqs)
            num_prompt_logprobs = next(b for b in LOGPROB_BUCKETS if b >= asked)
        result, prompt_logprobs = self.runner.execute(
            batch, tensors, plan.copies, num_logprobs, prompt_targets, num_prompt_logprobs
        )
        now = time.time()  # one clock reading for every token of the step
        for i in prompt_seqs:
            seq, start = seqs[i], int(batch.query_start[i])
            self.outputs.record_prompt_logprobs(
                seq.request, seq.num_computed_tokens, num_new_tokens[i], prompt_logprobs, start
            )
        block_size = self.config.block_size
        for seq, num_new in zip(seqs, num_new_tokens, strict=True):
            before = seq.num_computed_tokens
            seq.num_computed_tokens = after = before + num_new
            if after // block_size != before // block_size:  # a block filled up: make it hittable
                self.blocks.cache_full_blocks(seq.seq_id, seq.token_ids, after, seq.request.cache_salt)
        return self._append_samples(row_seqs, result, now)

    def _sampled_rows(
        self, seqs: list[SequenceState], num_new_tokens: list[int]
    ) -> tuple[list[int], list[SequenceState], list[int], bool, bool]:
        """One pass over the schedule: the scheduled index and sequence of every sampled row (a request's
        first token fans out to n rows), the scheduled indices that compute prompt logprobs, and whether every
        row has static sampling inputs, and is plain greedy (see Request). Counts the prompt tokens of requests
        getting their first token."""
        rows: list[int] = []
        row_seqs: list[SequenceState] = []
        prompt_seqs: list[int] = []
        all_static = all_plain = True
        for i, seq in enumerate(seqs):
            request = seq.request
            if request.prompt_logprobs is not None and self._computes_prompt_logprobs(seq):
                prompt_seqs.append(i)
            num_tokens = len(seq.token_ids)
            if seq.num_computed_tokens + num_new_tokens[i] != num_tokens:
                continue  # a prefill chunk short of the prompt's end samples nothing
            all_static = all_static and request.static_sampling
            all_plain = all_plain and request.plain_greedy
            rows.append(i)
            row_seqs.append(seq)
            if num_tokens == len(request.prompt_token_ids):  # first token: n samples, or a beam's proposals
                if seq.index == 0:
                    self.counters["prompt_tokens"] += num_tokens
                for _ in range(1, seq.num_sample_rows):
                    rows.append(i)
                    row_seqs.append(seq)
        return rows, row_seqs, prompt_seqs, all_static, all_plain

    def _append_samples(
        self, row_seqs: list[SequenceState], result: SamplerOutput, now: float
    ) -> list[RequestOutput]:
        """Give each sampled row's token to its sequence, or to its beam search; returns the outputs due (every
        advanced request's but FINAL_ONLY ones and beam searches, which report once, when done) and forgets
        the requests that finished."""
        targets = row_seqs
        if any(row and row_seqs[row - 1] is seq for row, seq in enumerate(row_seqs)):
            # parallel samples fork from the row before theirs, before any token of this step lands
            targets = [
                self._fork(seq) if seq.request.beam is None and row and row_seqs[row - 1] is seq else seq
                for row, seq in enumerate(row_seqs)
            ]
        self.counters["generation_tokens"] += len(targets)
        final_only = RequestOutputKind.FINAL_ONLY
        reporting = {  # requests that report every step, in row order
            seq.request.request_id: seq.request
            for seq in targets
            if seq.request.params.output_kind is not final_only and seq.request.beam is None
        }
        ended: dict[str, Request] = {}
        for seq in self.outputs.append_tokens(targets, result.token_ids.tolist(), now, result):
            self.scheduler.finish(seq)
            ended[seq.request.request_id] = seq.request
        if self.beams.active:
            ended.update(self.beams.advance(targets, result, now))
        outputs = [self.outputs.request_output(request) for request in reporting.values()]
        for request_id, request in ended.items():
            if not request.finished:
                continue
            if request.beam is not None:
                outputs.append(self.outputs.beam_search_output(request))
                self.beams.active.discard(request_id)
            elif request.params.output_kind is final_only:
                outputs.append(self.outputs.request_output(request))
            self.requests.pop(request_id, None)
        return outputs

    def _requeue(self, seq: SequenceState) -> None:
        """Recompute-preempt a running sequence: free its blocks and queue it as waiting."""
        self.scheduler.finish(seq)
        seq.num_computed_tokens = 0
        seq.prefix_matched = False
        self.scheduler.add(seq)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write copies of a step that ended up running nothing: they cannot wait for the next one."""
        if copies:
            k, v = self.runner.read_blocks([src for src, _ in copies])
            self.runner.write_blocks([dst for _, dst in copies], k, v)

    @staticmethod
    def _computes_prompt_logprobs(seq: SequenceState) -> bool:
        return (
            seq.request.prompt_logprobs is not None
            and seq.index == 0
            and seq.num_computed_tokens < seq.num_prompt_tokens - 1
        )

    def _run_swaps(self, swap_out, swap_in) -> None:
        """Host<->device block transfers, every read before any write (the block manager's contract)."""
        if not swap_out and not swap_in:
            return
        incoming = [(self._host_k[:, h].copy(), self._host_v[:, h].copy(), d) for h, d in swap_in]
        if swap_out:
            k, v = self.runner.read_blocks([d for d, _ in swap_out])
            for i, (_, host) in enumerate(swap_out):
                self._host_k[:, host], self._host_v[:, host] = k[:, i], v[:, i]
        if incoming:
            k = np.stack([k for k, _, _ in incoming], axis=1)
            v = np.stack([v for _, v, _ in incoming], axis=1)
            self.runner.write_blocks([d for _, _, d in incoming], k, v)

    def _fork(self, parent: SequenceState) -> SequenceState:
        """A parallel sample: shares the parent's blocks (copy-on-write) and its progress."""
        child = self._new_seq(parent.request, list(parent.token_ids), index=len(parent.request.seqs))
        child.num_computed_tokens = parent.num_computed_tokens
        child.prefix_matched = True
        self.blocks.fork(parent.seq_id, child.seq_id)
        self.outputs.attach(child)
        self.scheduler.add_running(child)
        return child

    def _new_seq(self, request: Request, token_ids: list[int], index: int) -> SequenceState:
        self._next_seq_id += 1
        seq = SequenceState(
            self._next_seq_id, request, token_ids, index=index, seed=sample_seed_for(request, index)
        )
        request.seqs.append(seq)
        return seq

    # ---- observability ----

    def metrics(self) -> dict[str, float]:
        blocks, scheduler = self.blocks, self.scheduler
        return {
            "num_requests_running": len({s.request.request_id for s in scheduler.running}),
            "num_requests_waiting": len(
                {s.request.request_id for s in [*scheduler.waiting, *scheduler.swapped]}
            ),
            "kv_cache_usage_perc": blocks.usage,
            "num_free_blocks": blocks.num_free_blocks,
            "num_total_blocks": blocks.num_total_blocks,
            "num_preemptions": scheduler.num_preemptions,
            "prefix_cache_queries": blocks.prefix_cache_queries,
            "prefix_cache_hits": blocks.prefix_cache_hits,
            "prompt_tokens": self.counters["prompt_tokens"],
            "generation_tokens": self.counters["generation_tokens"],
            "num_compilations": self.runner.num_compilations,
        }

    def reset_prefix_cache(self) -> bool:
        return self.blocks.reset_prefix_cache()
