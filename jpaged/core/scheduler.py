"""Iteration-level scheduling: every step a new batch under a token budget and a sequence cap.

Running sequences go first (decodes, and prompts still mid-prefill), then swapped-out ones come back, then waiting
prompts join, chunked when the budget is short. When a running sequence cannot get a block, the lowest-priority,
newest running sequence is preempted (recomputed later by default, or swapped to host memory).
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from dataclasses import dataclass, field

from jpaged.config import EngineConfig
from jpaged.core.block_manager import BlockManager
from jpaged.core.lora_slots import LoRASlots
from jpaged.core.sequence import SequenceState, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan. The scheduled sequences are two parallel lists (no object per sequence: the scheduler
    builds this for every running sequence every step): seqs[i] computes num_new_tokens[i] tokens from its
    num_computed_tokens on, and samples a new token when that reaches its last known token."""

    seqs: list[SequenceState] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[SequenceState] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), before the step

    def add(self, seq: SequenceState, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        # The LoRA adapters' device slots: a waiting request's adapter must find one before it runs.
        self.loras = LoRASlots(config.max_loras) if config.enable_lora else None
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []  # kept sorted by priority_key
        self.swapped: deque[SequenceState] = deque()
        self.num_preemptions = 0
        # A step's limits: the config's, or lower while warm-up still compiles the bigger steps' programs.
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self._arrivals = 0
        self._warned_preemption = False

    def limit_steps(self, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        """Build steps of at most these many tokens and sequence rows (what the compiled programs allow while a
        progressive warm-up goes on): prompts are chunked smaller, and requests that need more sequences at once
        than that wait."""
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def add(self, seq: SequenceState) -> None:
        self._arrivals += 1
        seq.arrival_order = self._arrivals
        seq.status = SequenceStatus.WAITING
        self._insert_waiting(seq)

    def add_running(self, seq: SequenceState) -> None:
        """A fork that already holds blocks (parallel sampling, beams) joins the running set directly."""
        self._arrivals += 1
        seq.arrival_order = self._arrivals
        self._hold_adapter(seq)  # its parent holds the adapter's slot: always there
        self._start_running(seq)

    def finish(self, seq: SequenceState) -> None:
        """Remove a sequence wherever it is and free its blocks (finished or aborted)."""
        self._remove(seq)
        self._free_blocks(seq)
        self._drop_adapter(seq)
        seq.status = SequenceStatus.FINISHED

    def requeue(self, seq: SequenceState) -> None:
        """Send a sequence back to waiting from wherever it is, its blocks freed: it recomputes from scratch (its
        full blocks stay in the prefix cache, so that is short)."""
        self._remove(seq)
        self._release(seq)
        self.add(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        running, allocate_slots = self.running, self.blocks.allocate_slots
        scheduled_seqs, scheduled_counts = out.seqs, out.num_new_tokens
        num_drafts = 0  # proposed tokens scheduled: each is a sampled row, as a sequence's next token is
        i = 0
        while i < len(running) and budget > 0:  # the hot loop (every running sequence, every step): kept lean
            seq = running[i]
            if seq.num_pending and seq.num_tokens >= seq.max_num_tokens:
                i += 1  # its pending token ends it (length): nothing left to compute
                continue
            computed = seq.num_computed_tokens
            num_new = seq.num_tokens - computed
            if seq.draft_token_ids:  # a decode with proposals verifies them too, where the budget has room
                if num_new + len(seq.draft_token_ids) <= budget:
                    num_new += len(seq.draft_token_ids)
                    num_drafts += len(seq.draft_token_ids)
                else:
                    seq.draft_token_ids = []
            if num_new > budget:
                num_new = budget
            while not allocate_slots(seq.seq_id, computed, num_new):
                if seq.draft_token_ids:  # its proposals give way before anyone is preempted
                    num_new -= len(seq.draft_token_ids)
                    num_drafts -= len(seq.draft_token_ids)
                    seq.draft_token_ids = []
                    continue
                victim = running.pop()
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                scheduled_seqs.append(seq)
                scheduled_counts.append(num_new)
                budget -= num_new
                i += 1
        if not out.preempted and (self.swapped or self.waiting):
            slots = self.max_num_seqs - sum(s.fan_out for s in running) - num_drafts
            budget, slots = self._schedule_swapped(out, budget, slots)
            self._schedule_waiting(out, budget, slots)
        out.copies = self.blocks.take_pending_copies()
        return out

    def _schedule_swapped(self, out: SchedulerOutput, budget: int, slots: int) -> tuple[int, int]:
        """Bring swapped sequences back while the budget and the free sequence slots allow; returns both left."""
        while self.swapped and budget > 0 and self.swapped[0].fan_out <= slots:
            seq = self.swapped[0]
            if not self.blocks.can_swap_in(seq.seq_id):
                break
            out.swap_in.extend(self.blocks.swap_in(seq.seq_id))
            self.swapped.popleft()
            self._start_running(seq)
            slots -= seq.fan_out
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.blocks.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new):
                break  # back on device; it gets its slot next step
            out.add(seq, num_new)
            budget -= num_new
        return budget, slots

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, slots: int) -> None:
        """Admit waiting prompts (chunked if need be) while the budget and the free sequence slots allow; a prompt
        whose LoRA adapter finds no device slot free waits, and those behind it go on."""
        no_slot: list[SequenceState] = []
        while self.waiting and budget > 0 and self.waiting[0].fan_out <= slots:
            seq = self.waiting[0]
            if not self._hold_adapter(seq):
                no_slot.append(self.waiting.popleft())
                continue
            if not seq.prefix_matched:
                seq.num_computed_tokens = self.blocks.match_prefix(
                    seq.seq_id, seq.token_ids, seq.request.cache_salt
                )
                seq.prefix_matched = True
                if seq.index == 0 and seq.num_tokens == len(seq.request.prompt_token_ids):
                    seq.request.num_cached_tokens = seq.num_computed_tokens
            num_new = seq.num_tokens - seq.num_computed_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if not self.blocks.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_new):
                self._release(seq)  # matched prefix blocks must not stay pinned by a waiting sequence
                break
            self.waiting.popleft()
            self._start_running(seq)
            slots -= seq.fan_out
            out.add(seq, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(no_slot))

    def _preempt(self, seq: SequenceState, out: SchedulerOutput) -> None:
        seq.draft_token_ids = []
        swap = self.config.preemption_mode == "swap" and self.blocks.can_swap_out(seq.seq_id)
        if swap:
            out.swap_out.extend(self.blocks.swap_out(seq.seq_id))
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
        else:
            self._release(seq)
            seq.status = SequenceStatus.WAITING
            self._insert_waiting(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)
        if not self._warned_preemption:
            self._warned_preemption = True
            logger.warning(
                "sequence %d preempted (%s): the KV cache is out of blocks; more blocks (kv_cache_memory, "
                "gpu_memory_utilization) or a lower max_num_seqs avoid it. Logged once.",
                seq.seq_id,
                "swap" if swap else "recompute",
            )

    def _start_running(self, seq: SequenceState) -> None:
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.priority_key)

    def _remove(self, seq: SequenceState) -> None:
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)

    def _free_blocks(self, seq: SequenceState) -> None:
        if self.blocks.has_seq(seq.seq_id):
            self.blocks.free(seq.seq_id)

    def _hold_adapter(self, seq: SequenceState) -> bool:
        """Whether `seq` may run as far as its adapter goes: none, held already, or a device slot found now."""
        lora_id = seq.request.lora_int_id
        if self.loras is None or not lora_id or seq.holds_lora:
            return True
        seq.holds_lora = self.loras.acquire(lora_id)
        return seq.holds_lora

    def _drop_adapter(self, seq: SequenceState) -> None:
        if seq.holds_lora:
            self.loras.release(seq.request.lora_int_id)
            seq.holds_lora = False

    def _release(self, seq: SequenceState) -> None:
        """Free its blocks and forget its progress: it starts again from its first token (prefix hits aside)."""
        self._drop_adapter(seq)
        self._free_blocks(seq)
        seq.num_computed_tokens = 0
        seq.prefix_matched = False

    def _insert_waiting(self, seq: SequenceState) -> None:
        keys = [s.priority_key for s in self.waiting]
        self.waiting.insert(bisect.bisect(keys, seq.priority_key), seq)
