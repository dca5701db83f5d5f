"""LLMEngine: requests in, one scheduled device step at a time, RequestOutputs out.

A step: the scheduler plans who runs and how many tokens (host core); the engine gathers the plan into a
ScheduledStep whose plain StepSchedule the runner pads and runs; the output processor gives each sampled token to
its sequence (or its beam search) and says which requests have output due.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from jpaged.config import EngineConfig
from jpaged.core.beam_search import BeamSearch
from jpaged.core.block_manager import BlockManager
from jpaged.core.prefix_doctor import SAMPLE, PrefixHint
from jpaged.core.scheduler import Scheduler
from jpaged.core.sequence import Request, SequenceState, SequenceStatus
from jpaged.engine.beam_driver import BeamDriver
from jpaged.engine.constrained_decoding import ConstrainedDecoding
from jpaged.engine.draft_model import DraftModel
from jpaged.engine.engine_metrics import ExpertLoad, TokenCounts, engine_metrics
from jpaged.engine.lora_adapters import LoRAAdapters, LoRAStats
from jpaged.engine.output_processor import OutputProcessor
from jpaged.engine.request_checks import RequestChecks
from jpaged.engine.scheduled_step import InFlightStep, SampledRows, ScheduledStep, scheduled_step
from jpaged.engine.speculation import SpecDecodeStats, Speculation
from jpaged.engine.startup import for_this_platform, size_kv_cache
from jpaged.engine.step_sampling import StepSampling, describe_sampling, sample_seed_for
from jpaged.engine.warmup_progress import WarmupProgress
from jpaged.lora_request import LoRARequest
from jpaged.models.llama import abstract_params, as_params, params_dtype
from jpaged.models.loader import LoadedModel, load_model
from jpaged.models.params import check_same_leaves, weights_spec
from jpaged.outputs import RequestOutput
from jpaged.runner import expert_load
from jpaged.runner.leader_runner import load_model_everywhere, start_runner
from jpaged.runner.model_runner import ModelRunner
from jpaged.runner.sampling_inputs import SamplerOutput
from jpaged.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from flax import nnx

    from jpaged.engine.startup import KVCacheSize

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 2048


class LLMEngine:
    """The synchronous engine loop: `add_request`, then `step()` until `has_unfinished()` is False."""

    def __init__(
        self, config: EngineConfig | None = None, *, model: LoadedModel | None = None, **engine_args
    ):
        config, dtype = for_this_platform(config or EngineConfig(**engine_args))
        self.config = config
        lazy = config.tensor_parallel_size > 1  # each device's part of each weight read from the files
        keep_blocks = config.keeps_checkpoint_quantization
        self.model = model or load_model_everywhere(config.model, dtype, lazy=lazy, keep_blocks=keep_blocks)
        self.model_config = mc = self.model.config
        source = self.model.source
        given_as = "the params given" if source.kind == "params" else f"the weights loaded from {source.path}"
        check_same_leaves(abstract_params(mc, params_dtype(self.model.params)), self.model.params, given_as)
        if config.enable_prefix_caching and mc.rope_depends_on_length:
            # A cached block holds keys rotated for the length of the request that computed it (LongRoPE's
            # short or long factors, dynamic NTK's base): another request's keys may differ.
            logger.warning(
                "prefix caching is off: %s RoPE rotates by sequence length", mc.rope_scaling_dict["rope_type"]
            )
            self.config = config = dataclasses.replace(config, enable_prefix_caching=False)
        self.tokenizer = self.model.tokenizer
        self.max_model_len = config.max_model_len or min(mc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        draft = None
        if config.draft_model:  # held as the target is (a quantized checkpoint's matrices as stored)
            draft = load_model(config.draft_model, dtype, progress=False, keep_blocks=keep_blocks)
        size = size_kv_cache(config, self.model, self.max_model_len, draft)
        self.blocks = BlockManager(
            size.num_blocks, config.block_size, config.enable_prefix_caching, size.num_swap_blocks
        )
        self.scheduler = Scheduler(config, self.blocks)
        self.checks = RequestChecks(config, self.max_model_len, mc.vocab_size)
        self.loras = LoRAAdapters(config, mc, self.scheduler.loras)
        self.runner = self._start_runner(size, from_memory=source.kind == "params")
        # The runner holds the weights from here on; the engine keeps their shapes (what update_weights checks).
        self.model = dataclasses.replace(self.model, params=weights_spec(self.model.params))
        self.outputs = OutputProcessor(self.tokenizer, mc.eos_token_ids, self.max_model_len)
        self.beams = BeamDriver(
            config,
            mc.eos_token_ids,
            self.max_model_len,
            self.blocks.num_total_blocks,
            fork=self._fork,
            requeue=self.scheduler.requeue,
            finish=self.scheduler.finish,
        )
        self.constrained = ConstrainedDecoding(self.tokenizer, mc.vocab_size, mc.eos_token_ids or ())
        self.sampling = StepSampling(
            self.runner.sampling_tensors, (mc.eos_token_ids or (None,))[0], self.constrained.bitmasks
        )
        self.draft = None
        if draft is not None:
            self.draft = DraftModel(config, draft, self.runner, self.blocks, **size.runner_args)
        self.speculation = None
        if config.speculative_config is not None:
            batch_proposer = None if self.draft is None else self.draft.propose
            self.speculation = Speculation(config.speculative_config, config, batch_proposer)
        self.requests: dict[str, Request] = {}
        self._rng = np.random.default_rng(config.seed)
        self._next_seq_id = 0
        self._private_salts = itertools.count()
        self.counters = TokenCounts()
        self._expert_load = ExpertLoad(expert_load.BUCKETS) if mc.num_experts else None
        self._in_flight: InFlightStep | None = None  # launched, its tokens not processed yet (async)
        self._held: list[RequestOutput] = []  # outputs processed outside step(), returned by the next one
        self._prefix_hint = PrefixHint(config.block_size) if config.enable_prefix_caching else None
        self.warmup_seconds = 0.0
        if not config.enforce_eager:
            progressive = config.warmup == "progressive"
            self.warmup_seconds = self.runner.warmup(progressive=progressive)
            if self.draft is not None:
                self.warmup_seconds += self.draft.warmup(progressive)
        self.warmup = WarmupProgress(
            [self.runner, *([self.draft.runner] if self.draft else [])], self.scheduler
        )

    def _start_runner(self, size: KVCacheSize, *, from_memory: bool) -> ModelRunner:
        """The runner for this engine's steps, of the kind `_runner_class` says."""
        return start_runner(
            self.config,
            self.model_config,
            self.model.params,
            from_memory=from_memory,
            num_blocks=size.num_blocks,
            max_model_len=self.max_model_len,
            num_swap_blocks=size.num_swap_blocks,
            runner_class=self._runner_class(),
        )

    def _new_prompt(
        self, request_id: str, prompt: str | Sequence[int], *, add_special_tokens: bool
    ) -> tuple[str | None, list[int]]:
        """A new request's text (None for token ids) and token ids; ValueError while asleep or for an id in use."""
        if self.runner.asleep:
            raise ValueError("the engine is asleep (sleep was called): call wake_up before adding requests")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return None, [int(t) for t in prompt]

    def _runner_class(self) -> Callable[..., ModelRunner]:
        """What builds this engine's runner (a pooling engine builds its own kind)."""
        return ModelRunner

    # ---- requests ----

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | BeamSearchParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Queue a request (through a LoRA adapter, registered on first use). BeamSearchParams make it a beam
        search: its output comes once, when it is done."""
        params = params or SamplingParams()
        text, token_ids = self._new_prompt(request_id, prompt, add_special_tokens=False)
        self.checks.check_prompt(token_ids)
        lora_id = 0
        if lora_request is not None:
            lora_id, adapter_key = self.loras.for_request(lora_request)
            cache_salt = f"{cache_salt or ''}{adapter_key}"
        beam = None
        if isinstance(params, BeamSearchParams):
            beam = self.new_beam_search(len(token_ids), params)
            params = beam.sampling_params()
        else:
            self.checks.check_params(params)
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**63))
        if params.prompt_logprobs is not None:
            # Logprobs are needed at every prompt position, so prefix hits from other requests must not skip
            # any (vLLM turns prefix caching off for such requests): a private salt gives its blocks their own
            # hashes, and its own hits after a preemption cover only positions it already computed.
            cache_salt = f"{cache_salt or ''}\0prompt_logprobs:{next(self._private_salts)}"
        request = Request(
            request_id, text, token_ids, params, seed, time.time(), priority, cache_salt, beam=beam
        )
        request.lora_int_id = lora_id
        describe_sampling(request, self.tokenizer)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(token_ids)
        if beam is not None:
            self.beams.active.add(request_id)
        seq = self._new_seq(request, list(token_ids), index=0)
        self.outputs.attach(seq)
        if params.structured_outputs is None:
            self.scheduler.add(seq)
        else:
            self.constrained.hold(seq)  # scheduled once its grammar compiled
        self.requests[request_id] = request
        if self._prefix_hint and (advice := self._prefix_hint.observe(request_id, token_ids)):
            logger.warning("prefix caching, from the first %d requests: %s", SAMPLE, advice)
        return request

    def new_beam_search(self, num_prompt_tokens: int, params: BeamSearchParams) -> BeamSearch:
        """A beam search for a prompt of this length, checked against this engine (see BeamDriver)."""
        return self.beams.new_search(num_prompt_tokens, params)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now: its blocks are freed at once. Returns its final output (finish_reason 'abort',
        unless its last token finished it), with every token computed so far: a step still running for it is
        processed first (the other requests' outputs from it come with the next step)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        in_flight = self._in_flight
        if in_flight is not None and any(seq.request is request for seq in in_flight.scheduled.seqs):
            self._held += self._complete(self._take_in_flight())  # no output of its own: it is popped
        self.beams.active.discard(request_id)
        self.constrained.discard(request_id)
        for seq in request.seqs:
            self.outputs.abort(seq)
            self.scheduler.finish(seq)
            if self.speculation is not None:
                self.speculation.finished(seq, aborted=True)
        if not self.requests and self._in_flight is not None:  # idle now: what runs is for nobody
            self._held += self._complete(self._take_in_flight())
        if request.beam is not None:
            return self.outputs.beam_search_output(request, aborted=True)
        return self.outputs.request_output(request)

    def has_unfinished(self) -> bool:
        """Whether a step is still due: a request runs or waits, or outputs wait to be returned."""
        return bool(self.requests or self._held)

    def warm_up_while_idle(self) -> bool:
        """For a loop with no request to step: run one step shape that has not run yet (see
        ModelRunner.warmup), so no later request pays its first run; False once every shape has run (or while
        asleep)."""
        self.warmup.engine_idle(True)
        self.warmup.follow()
        return not self.runner.asleep and self.runner.run_unrun_shape()

    # ---- LoRA adapters (vLLM's names) ----

    def add_lora(self, lora_request: LoRARequest, weights=None) -> bool:
        """Register an adapter: read from its PEFT directory, or given as `weights` in the engine's own layout."""
        return self.loras.add(lora_request, weights)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.loras.remove(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.loras.list()

    def lora_stats(self) -> LoRAStats:
        return self.loras.stats()

    def update_lora(self, name: str, weights) -> None:
        """Swap adapter `name`'s matrices in place (PEFT-named arrays of its shapes, e.g. a trainer's): nothing
        recompiles; its prefix-cache blocks stop matching."""
        self._check_idle("update_lora")
        self.loras.update(name, weights)

    # ---- weights and device memory, between generate calls ----

    def update_weights(self, weights: dict | nnx.State | nnx.Module) -> None:
        """Swap the model's weights in place: a CausalLM of the same config, its nnx.State, or its state dict (host
        or device arrays, e.g. a trainer's). Every leaf keeps its shape and dtype, so nothing recompiles; the
        prefix cache is dropped, since its KV came from the old weights."""
        self._check_idle("update_weights")
        params = as_params(weights)
        check_same_leaves(self.model.params, params)
        self.runner.update_weights(params)
        self.blocks.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Give the KV pool's device memory back, and the weights' (level 1: a host copy is kept for wake_up;
        level 2: none is, so update_weights comes before wake_up), for a trainer sharing the device."""
        self._check_idle("sleep")
        self.runner.sleep(level)
        self.blocks.reset_prefix_cache()

    def wake_up(self) -> None:
        """Serve again after sleep: the pool (empty) and the weights back on the device; nothing recompiles."""
        if self.runner.asleep:
            self.runner.wake_up()

    def _check_idle(self, what: str) -> None:
        if self.requests:
            raise ValueError(f"{what} needs an idle engine: {len(self.requests)} requests are unfinished")

    # ---- the loop ----

    def step(self) -> list[RequestOutput]:
        """Schedule and start one device step, and process the tokens of the step before it; returns the outputs
        due: every advanced request's, except FINAL_ONLY ones (and beam searches) until they finish.

        With async_scheduling a step is scheduled while the one before runs, so the host's work overlaps the
        device's, and its outputs come from the next call. A step whose results the next schedule needs (forks
        for n > 1, beam searches, sampling inputs that read the tokens) is processed in the call that starts it,
        as every step is without async scheduling."""
        self._admit_constrained()
        self.warmup.engine_idle(False)
        self.warmup.follow()
        outputs, self._held = self._held, []
        if self._in_flight is not None and self._speculates():
            outputs += self._complete(self._take_in_flight())  # proposals follow a sequence's latest token
        scheduled = self._schedule()
        launched = None if scheduled is None else self._launch(scheduled)
        if self._in_flight is not None:
            outputs += self._complete(self._take_in_flight())
        if launched is None:
            if not outputs and self.warmup.remaining:
                self.warmup.wait()  # nothing fits the steps compiled so far: wait for more rather than spin
            return outputs
        if self.config.async_scheduling and self.requests and not launched.needs_results:
            self._in_flight = launched
            return outputs
        return outputs + self._complete(launched)

    def _admit_constrained(self) -> None:
        """Schedule the requests whose grammar compiled; end those whose grammar did not (abort, logged). With
        nothing else to run, wait a little for a grammar rather than spin."""
        constrained = self.constrained
        if not constrained.num_waiting:
            return
        if not self.scheduler.num_unfinished and self._in_flight is None and not self._held:
            constrained.wait(timeout=0.05)
        ready, failed = constrained.ready()
        for seq in ready:
            self.scheduler.add(seq)
        for request, error in failed:
            logger.warning("request %s: structured outputs: %s", request.request_id, error)
            self._held.append(self.abort_request(request.request_id))

    def _speculates(self) -> bool:
        return self.speculation is not None and self.speculation.active(self.scheduler.running)

    def _take_in_flight(self) -> InFlightStep:
        step, self._in_flight = self._in_flight, None
        return step

    def _schedule(self) -> ScheduledStep | None:
        """The scheduler's plan for this step, with its swaps done; None when it runs no sequence."""
        if self.speculation is not None:
            self.speculation.propose(self.scheduler.running)
        plan = self.scheduler.schedule()
        self.runner.swap(plan.swap_out, plan.swap_in)
        seqs, num_new_tokens = plan.seqs, plan.num_new_tokens
        if self.beams.active:
            seqs, num_new_tokens = self.beams.keep_in_lockstep(seqs, num_new_tokens)
        self.runner.copy_blocks(plan.copies)  # before the step that writes into the copies
        if self.draft is not None:
            self.draft.copy_blocks(plan.copies)
        if not seqs:
            return None
        tables = self.blocks.block_tables([seq.seq_id for seq in seqs])
        lora_slot_of = None
        if self.config.enable_lora:
            self.loras.load_pending(self.runner.write_lora)  # before the step that reads them
            lora_slot_of = self.loras.slot_of
        scheduled = scheduled_step(seqs, num_new_tokens, tables, lora_slot_of)
        self.counters.prompt_tokens += scheduled.num_first_prompt_tokens
        return scheduled

    def _launch(self, scheduled: ScheduledStep) -> InFlightStep:
        """Start the forward, build the sampling inputs (grammar masks) while it runs, then start the sampling. The
        scheduled tokens count as computed from here on, and each sampled sequence as one token ahead (pending)
        until its token comes back, so the next schedule can plan past it."""
        prepared = self.runner.prepare(scheduled.schedule)
        rows = scheduled.rows
        self.runner.forward(prepared)
        if self.draft is not None:  # the draft computes the step's KV too, taking inputs from the same tokens
            self.draft.catch_up(prepared, self.runner.last_tokens)
        pending = self.runner.sample(self.sampling.inputs(rows, prepared.num_rows))
        for seq, num_new in zip(scheduled.seqs, scheduled.num_new_tokens, strict=True):
            seq.num_computed_tokens += num_new
        fans_out = False
        for row, seq in enumerate(rows.seqs):
            if rows.forks(row):
                fans_out = True  # forks when its tokens come back
            elif seq.request.beam is None and not seq.draft_token_ids:
                seq.num_pending += 1
                seq.pending_row = row
        verifies = rows.draft_positions is not None  # how many tokens it keeps is known once they are back
        needs_results = fans_out or verifies or not rows.all_static or bool(self.beams.active)
        return InFlightStep(scheduled, prepared, pending, needs_results)

    def _complete(self, step: InFlightStep) -> list[RequestOutput]:
        """A launched step's results into the sequences (waiting for them): prompt logprobs, progress (full blocks
        become hittable), then the sampled tokens."""
        output = step.output.result()
        now = time.time()  # one clock reading for every token of the step
        if output.expert_load is not None:
            self._expert_load.add(output.expert_load)
        scheduled = step.scheduled
        seqs, num_new_tokens = scheduled.seqs, scheduled.num_new_tokens
        computed = scheduled.schedule.num_computed
        rows, sampled = scheduled.rows, output.sampled
        if rows.draft_positions is not None:
            rows, sampled = self.speculation.accept(rows, sampled)  # drops each sequence's rejected tokens
        for i in scheduled.prompt_logprob_seqs:
            seq, start = seqs[i], int(step.prepared.batch.query_start[i])
            self.outputs.record_prompt_logprobs(
                seq.request, computed[i], num_new_tokens[i], output.prompt_logprobs, start
            )
        block_size = self.config.block_size
        running = SequenceStatus.RUNNING
        for seq, before, num_new in zip(seqs, computed, num_new_tokens, strict=True):
            after, token_ids = before + num_new, seq.token_ids
            if seq.draft_token_ids:  # verified (a step run alone): its computed tokens less the rejected ones
                after, token_ids = seq.num_computed_tokens, token_ids + seq.draft_token_ids
                seq.draft_token_ids = []
            # a block filled up: make it hittable (unless the sequence let its blocks go while the step ran)
            if after // block_size != before // block_size and seq.status is running:
                self.blocks.cache_full_blocks(seq.seq_id, token_ids, after, seq.request.cache_salt)
        return self._append_samples(rows, sampled, now)

    def _append_samples(self, rows: SampledRows, result: SamplerOutput, now: float) -> list[RequestOutput]:
        """Give each sampled row's token to its sequence, or to its beam search; returns the outputs due (every
        advanced request's but FINAL_ONLY ones and beam searches, which report once, when done) and forgets
        the requests that finished. Rows of sequences that ended while the step ran are dropped."""
        targets = row_seqs = rows.seqs
        if any(rows.forks(row) for row in range(1, len(row_seqs))):
            # parallel samples fork from the row before theirs, before any token of this step lands
            targets = [
                self._fork(seq)
                if seq.request.beam is None and seq.finish_reason is None and rows.forks(row)
                else seq
                for row, seq in enumerate(row_seqs)
            ]
        final_only = RequestOutputKind.FINAL_ONLY
        reporting = {}  # requests that report every step, in row order
        num_live = 0
        for seq in targets:
            if seq.finish_reason is None:
                num_live += 1
                request = seq.request
                if request.params.output_kind is not final_only and request.beam is None:
                    reporting[request.request_id] = request
        self.counters.generation_tokens += num_live
        ended: dict[str, Request] = {}
        for seq in self.outputs.append_tokens(targets, result.token_ids.tolist(), now, result):
            self.scheduler.finish(seq)
            if self.speculation is not None:
                self.speculation.finished(seq)
            ended[seq.request.request_id] = seq.request
        if self.beams.active:
            ended.update(self.beams.advance(targets, result, now))
        requests = self.requests  # an aborted request is gone from here: its output is abort_request's
        outputs = [self.outputs.request_output(r) for r in reporting.values() if r.request_id in requests]
        for request_id, request in ended.items():
            if not request.finished or request_id not in requests:
                continue
            if request.beam is not None:
                outputs.append(self.outputs.beam_search_output(request))
                self.beams.active.discard(request_id)
            elif request.params.output_kind is final_only:
                outputs.append(self.outputs.request_output(request))
            self.requests.pop(request_id, None)
        return outputs

    def _fork(self, parent: SequenceState) -> SequenceState:
        """A parallel sample: shares the parent's blocks (copy-on-write) and its progress."""
        child = self._new_seq(parent.request, list(parent.token_ids), index=len(parent.request.seqs))
        child.num_computed_tokens = parent.num_computed_tokens
        child.prefix_matched = True
        child.grammar = parent.grammar.fork() if parent.grammar is not None else None
        self.blocks.fork(parent.seq_id, child.seq_id)
        self.outputs.attach(child)
        self.scheduler.add_running(child)
        return child

    def _new_seq(self, request: Request, token_ids: list[int], index: int) -> SequenceState:
        self._next_seq_id += 1
        max_tokens = request.params.max_tokens
        seq = SequenceState(
            self._next_seq_id,
            request,
            token_ids,
            index=index,
            seed=sample_seed_for(request, index),
            max_num_tokens=min(
                self.max_model_len,
                self.max_model_len if max_tokens is None else len(request.prompt_token_ids) + max_tokens,
            ),
        )
        request.seqs.append(seq)
        return seq

    # ---- observability ----

    def metrics(self) -> dict[str, float]:
        """Queue sizes, KV usage, token and prefix-cache counters, compilations (see engine_metrics), and with
        speculative_config, vLLM's spec_decode counters."""
        values = engine_metrics(self.blocks, self.scheduler, self.counters, self.warmup.counts())
        if self.speculation is not None:
            values.update(self.speculation.stats.counters())
        return values

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Speculative decoding's counters so far (a copy; None without speculative_config)."""
        if self.speculation is None:
            return None
        return dataclasses.replace(
            self.speculation.stats, accepted_per_position=list(self.speculation.stats.accepted_per_position)
        )

    def expert_load(self) -> ExpertLoad | None:
        """A mixture of experts' load histogram so far (a copy; None for a dense model): how many of a step's
        tokens each expert of each layer took, one observation each."""
        load = self._expert_load
        return None if load is None else ExpertLoad(load.buckets, list(load.counts), load.total)

    def reset_prefix_cache(self) -> bool:
        return self.blocks.reset_prefix_cache()
