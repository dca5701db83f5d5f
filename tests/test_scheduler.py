"""The scheduler alone (no model): who runs each step, how many tokens each, and who waits."""

from __future__ import annotations

from jpaged.config import EngineConfig
from jpaged.core.block_manager import BlockManager
from jpaged.core.scheduler import Scheduler
from jpaged.core.sequence import Request, SequenceState, SequenceStatus
from jpaged.sampling_params import SamplingParams


def make(num_blocks: int = 64, **config) -> Scheduler:
    config = EngineConfig(**{"max_num_seqs": 4, "max_num_batched_tokens": 64, "block_size": 8, **config})
    return Scheduler(config, BlockManager(num_blocks, config.block_size))


def request(seq_id: int, prompt_len: int, n: int = 1) -> SequenceState:
    params = SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0)
    prompt = [seq_id * 1000 + i for i in range(prompt_len)]
    req = Request(f"r{seq_id}", None, prompt, params, seed=0, arrival_time=0.0)
    seq = SequenceState(seq_id, req, list(prompt))
    req.seqs.append(seq)
    return seq


def run_step(scheduler: Scheduler) -> list[tuple[int, int]]:
    """Schedule one step, then act as the engine: count the computed tokens and append a sampled token."""
    plan = scheduler.schedule()
    for seq, num_new in zip(plan.seqs, plan.num_new_tokens, strict=True):
        seq.num_computed_tokens += num_new
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
    return [(seq.seq_id, num_new) for seq, num_new in zip(plan.seqs, plan.num_new_tokens, strict=True)]


def test_prompts_are_chunked_under_the_token_budget_then_decode_one_token_each():
    scheduler = make(max_num_batched_tokens=32)
    for seq_id, length in ((1, 20), (2, 30)):
        scheduler.add(request(seq_id, length))
    assert run_step(scheduler) == [(1, 20), (2, 12)]
    assert run_step(scheduler) == [(1, 1), (2, 18)]
    assert run_step(scheduler) == [(1, 1), (2, 1)]


def test_waiting_prompts_take_only_the_free_sequence_slots_counting_their_samples():
    scheduler = make(max_num_seqs=4)
    scheduler.add(request(1, 8, n=3))  # holds three slots from the start: it forks at its first token
    scheduler.add(request(2, 8))
    scheduler.add(request(3, 8))
    assert run_step(scheduler) == [(1, 8), (2, 8)]
    assert [seq.seq_id for seq in scheduler.waiting] == [3]


def test_a_preempted_sequence_is_recomputed_after_the_others_and_frees_its_blocks():
    scheduler = make(num_blocks=5, block_size=8)  # 4 usable blocks
    for seq_id in (1, 2):
        scheduler.add(request(seq_id, 16))
    assert run_step(scheduler) == [(1, 16), (2, 16)]  # two full blocks each: the pool is used up
    assert run_step(scheduler) == [(1, 1)]  # 1 needs a third block: the newest, 2, makes room
    victim = scheduler.waiting[0]
    assert victim.seq_id == 2 and victim.status is SequenceStatus.WAITING and victim.num_computed_tokens == 0
    assert scheduler.num_preemptions == 1


def test_a_requeued_running_sequence_frees_its_blocks_and_waits_to_start_over():
    scheduler = make()
    first, second = request(1, 12), request(2, 12)
    for seq in (first, second):
        scheduler.add(seq)
    run_step(scheduler)
    free_before = scheduler.blocks.num_free_blocks
    scheduler.requeue(first)
    assert first.status is SequenceStatus.WAITING and first.num_computed_tokens == 0
    assert list(scheduler.waiting) == [first] and scheduler.running == [second]
    assert scheduler.blocks.num_free_blocks == free_before + 2  # its two blocks (12 tokens + 1, blocks of 8)
    scheduler.finish(second)
    scheduler.finish(first)
    assert scheduler.blocks.num_free_blocks == scheduler.blocks.num_total_blocks  # every usable block
