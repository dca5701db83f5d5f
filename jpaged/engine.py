"""LLMEngine: requests in, one scheduled device step at a time, RequestOutputs out."""

from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from jpaged.beam_search import BeamSearch, BeamSearchParams
from jpaged.block_manager import BlockManager
from jpaged.config import EngineConfig
from jpaged.kv_cache_sizing import (
    check_max_model_len_fits,
    configure_accelerator_allocator,
    determine_num_blocks,
    kv_bytes_per_token,
    startup_summary,
)
from jpaged.models.loader import LoadedModel, load_model
from jpaged.output_processor import OutputProcessor
from jpaged.outputs import RequestOutput
from jpaged.sampler import LOGPROB_BUCKETS, SamplerOutput, SamplingRow, logprobs_bucket
from jpaged.sampling_params import SamplingParams
from jpaged.scheduler import ScheduledSeq, Scheduler
from jpaged.sequence import Request, SequenceStatus
from jpaged.sequence import Sequence as Seq

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
            from jpaged.model_runner import activation_peak_bytes

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
        from jpaged.model_runner import ModelRunner

        self.runner = ModelRunner(config, mc, self.model.params, num_blocks, self.max_model_len)
        self._host_k = self._host_v = None
        if config.preemption_mode == "swap" and num_swap_blocks:
            shape = (mc.num_layers, num_swap_blocks, config.block_size, mc.num_kv_heads, mc.head_dim)
            self._host_k, self._host_v = np.zeros(shape, dtype), np.zeros(shape, dtype)
        self.outputs = OutputProcessor(self.tokenizer, mc.eos_token_ids, self.max_model_len)
        self.requests: dict[str, Request] = {}
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
        params.verify_for_vocab(self.model_config.vocab_size)
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**63))
        if params.prompt_logprobs is not None:
            # Logprobs are needed at every prompt position, so prefix hits from other requests must not skip
            # any (vLLM turns prefix caching off for such requests): a private salt gives its blocks their own
            # hashes, and its own hits after a preemption cover only positions it already computed.
            cache_salt = f"{cache_salt or ''}\0prompt_logprobs:{next(self._private_salts)}"
        request = Request(
            request_id, text, token_ids, params, seed, time.time(), priority, cache_salt, beam=beam
        )
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(token_ids)
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

    def new_beam_search(self, num_prompt_tokens: int, params: BeamSearchParams) -> BeamSearch:
        """A beam search for a prompt of this length, checked against this engine: its beams advance together,
        so all of them must fit in the block pool at full length at once."""
        search = BeamSearch.start(
            params, self.model_config.eos_token_ids, self.max_model_len - num_prompt_tokens
        )
        size = self.config.block_size
        per_beam = -(-(num_prompt_tokens % size + search.max_tokens) // size)  # after the shared full blocks
        needed = num_prompt_tokens // size + params.beam_width * per_beam
        if needed > self.blocks.num_total_blocks:
            raise ValueError(
                f"beam_width={params.beam_width} beams of {num_prompt_tokens} + {search.max_tokens} tokens may need "
                f"{needed} KV blocks at once, more than the {self.blocks.num_total_blocks} of the pool: lower "
                "beam_width or max_tokens"
            )
        return search

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now: its blocks are freed at once. Returns its final output (finish_reason 'abort')."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
            self.scheduler.finish(seq)
        if request.beam is not None:
            return self.outputs.beam_search_output(request, aborted=True)
        return self.outputs.request_output(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the loop ----

    def step(self) -> list[RequestOutput]:
        """Schedule, run one device step, process its tokens; returns outputs of requests that progressed."""
        plan = self.scheduler.schedule()
        self._run_swaps(plan.swap_out, plan.swap_in)
        scheduled = self._keep_beams_in_lockstep(plan.scheduled)
        if not scheduled:
            self._copy_blocks(plan.copies)
            return []
        rows, row_seqs = [], []  # scheduled index and sequence of every sampled row
        for i, item in enumerate(scheduled):
            if item.samples:
                seq = item.seq
                for k in range(seq.num_sample_rows):
                    rows.append(i)
                    row_seqs.append((seq, self._sample_seed_for(seq.request, seq.index + k)))
        tables = [self.blocks.block_table(s.seq.seq_id) for s in scheduled]
        prompt_seqs = [i for i, item in enumerate(scheduled) if self._computes_prompt_logprobs(item)]
        batch, num_rows, prompt_targets = self.runner.prepare(scheduled, tables, rows, prompt_seqs)
        sampling_rows = [
            SamplingRow(
                seq.request.params, seq.request.prompt_token_ids, seq.output_token_ids, seed, self._eos(seq)
            )
            for seq, seed in row_seqs
        ]
        tensors = self.runner.sampling_tensors(sampling_rows, num_rows)
        num_prompt_logprobs = None
        if prompt_seqs:
            asked = max(scheduled[i].seq.request.params.prompt_logprobs for i in prompt_seqs)
            num_prompt_logprobs = next(b for b in LOGPROB_BUCKETS if b >= asked)
        result, prompt_logprobs = self.runner.execute(
            batch, tensors, plan.copies, logprobs_bucket(sampling_rows), prompt_targets, num_prompt_logprobs
        )
        for i in prompt_seqs:
            item = scheduled[i]
            start = int(batch.query_start[i])
            self.outputs.record_prompt_logprobs(
                item.seq.request, item.seq.num_computed_tokens, item.num_new_tokens, prompt_logprobs, start
            )
        for item in scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.blocks.cache_full_blocks(
                seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.request.cache_salt
            )
        touched = self._append_samples([seq for seq, _ in row_seqs], result)
        outputs = []
        for request in touched.values():
            if request.beam is None:
                outputs.append(self.outputs.request_output(request))
            elif request.beam.done:  # a beam search reports once, when done
                outputs.append(self.outputs.beam_search_output(request))
            if request.finished:
                self.requests.pop(request.request_id, None)
        return outputs

    def _append_samples(self, row_seqs: list[Seq], result: SamplerOutput) -> dict[str, Request]:
        """Give each sampled row's token to its sequence, or to its beam search; returns the requests touched."""
        targets = []  # parallel samples fork from the row before theirs, before any token of this step lands
        for row, seq in enumerate(row_seqs):
            fork = seq.request.beam is None and row and row_seqs[row - 1] is seq
            targets.append(self._fork(seq) if fork else seq)
        touched: dict[str, Request] = {}
        proposals: dict[Request, dict[Seq, list[tuple[int, float]]]] = defaultdict(dict)
        for row, seq in enumerate(targets):
            request = touched[seq.request.request_id] = seq.request
            if seq.index == 0 and not seq.output_token_ids:
                self.counters["prompt_tokens"] += seq.num_prompt_tokens
            self.counters["generation_tokens"] += 1
            if request.beam is not None:
                k = request.beam.num_candidates
                ids, values = result.logprob_token_ids[row, 1 : 1 + k], result.logprobs[row, 1 : 1 + k]
                proposals[request][seq] = list(zip(ids.tolist(), values.tolist(), strict=True))
                continue
            self.outputs.append_token(seq, result, row)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
        for request, by_seq in proposals.items():
            self._advance_beams(request, [by_seq[seq] for seq in request.seqs])
        return touched

    def _advance_beams(self, request: Request, proposals: list[list[tuple[int, float]]]) -> None:
        """Apply one beam search decision: a beam chosen k times forks k - 1 times (sharing its blocks, copy on
        write), each new beam appends its token, and beams nobody continues are freed at once."""
        parents = request.beam.step(proposals)
        old, continued = list(request.seqs), set()
        beams = []
        for parent in parents:  # every fork is taken before any token lands
            beams.append(self._fork(old[parent]) if parent in continued else old[parent])
            continued.add(parent)
        for seq, beam in zip(beams, request.beam.beams, strict=True):
            seq.token_ids.append(beam.token_ids[-1])
        for index, seq in enumerate(old):
            if index not in continued:
                self.scheduler.finish(seq)
        request.seqs = beams
        now = time.time()
        request.first_token_time = request.first_token_time or now
        request.last_token_time = now

    def _keep_beams_in_lockstep(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """The beams of a request are chosen together, so a beam samples only in a step where all its live
        siblings sample. A split step holds the sampling ones back; when a sibling is out of the running set
        (preempted), the running ones go back to waiting too, so the blocks they hold can bring it back
        (their full blocks stay cached, so the recompute is short)."""
        sampling: dict[Request, list[ScheduledSeq]] = defaultdict(list)
        for item in scheduled:
            if item.samples and item.seq.request.beam is not None:
                sampling[item.seq.request].append(item)
        dropped: set[int] = set()
        for request, items in sampling.items():
            if len(items) == len(request.seqs):
                continue
            dropped.update(item.seq.seq_id for item in items)
            if any(seq.status is not SequenceStatus.RUNNING for seq in request.seqs):
                for seq in request.seqs:
                    if seq.status is SequenceStatus.RUNNING:
                        self._requeue(seq)
                        dropped.add(seq.seq_id)
        return [item for item in scheduled if item.seq.seq_id not in dropped]

    def _requeue(self, seq: Seq) -> None:
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
    def _computes_prompt_logprobs(item: ScheduledSeq) -> bool:
        seq = item.seq
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

    def _fork(self, parent: Seq) -> Seq:
        """A parallel sample: shares the parent's blocks (copy-on-write) and its progress."""
        child = self._new_seq(parent.request, list(parent.token_ids), index=len(parent.request.seqs))
        child.num_computed_tokens = parent.num_computed_tokens
        child.prefix_matched = True
        self.blocks.fork(parent.seq_id, child.seq_id)
        self.outputs.attach(child)
        self.scheduler.add_running(child)
        return child

    def _new_seq(self, request: Request, token_ids: list[int], index: int) -> Seq:
        self._next_seq_id += 1
        seq = Seq(
            self._next_seq_id, request, token_ids, index=index, seed=self._sample_seed_for(request, index)
        )
        request.seqs.append(seq)
        return seq

    @staticmethod
    def _sample_seed_for(request: Request, index: int) -> int:
        """Sample i of a request draws from its own stream: reproducible, independent of batch composition."""
        return (request.seed + index * 0x9E3779B97F4A7C15) % 2**63

    def _eos(self, seq: Seq) -> int | None:
        return None if seq.request.params.ignore_eos else (self.model_config.eos_token_ids or (None,))[0]

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
