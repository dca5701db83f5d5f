"""KV memory efficiency of paged blocks vs contiguous max-length reservation, simulated without a model.

Workload (seeded): every request arrives at t=0 (an offline batch, so memory stays saturated).
  prompt length  ~ LogNormal(median 256, sigma 0.8) tokens, clipped to [8, 1536]
  output length  ~ 1 + Exponential(mean 200) tokens, capped at max_model_len - prompt: the request may run to
                   the context limit, but most stop early (86% before 400 tokens), as chat traffic does.
Both schedulers get the same KV memory: room for `--reserved-seqs` contiguous max_model_len reservations.
  paged       the engine's loop over jpaged's BlockManager: running sequences decode first, one token per step
              (allocate_slots of 1 token as tokens are produced), the newest is preempted (recompute) when blocks
              run out, then waiting prompts are admitted while their blocks fit above a 1% watermark.
  contiguous  each running request owns max_model_len slots from admission to finish.
Steady state = the steps during which requests are still waiting (memory is the bottleneck).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jpaged.core.block_manager import BlockManager  # noqa: E402

WATERMARK_FRACTION = 0.01  # vLLM's default admission watermark: keeps decodes from preempting at once


@dataclass
class Request:
    seq_id: int
    prompt_len: int
    output_len: int
    computed: int = 0  # tokens in the KV cache
    generated: int = 0  # tokens sampled


@dataclass
class Stats:
    steps: int = 0
    steady_steps: int = 0
    running_sum: int = 0
    tokens_sum: int = 0
    slots_sum: int = 0
    preemptions: int = 0
    manager_seconds: float = 0.0
    manager_calls: int = 0


def make_workload(num_requests: int, max_model_len: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for seq_id in range(num_requests):
        prompt_len = min(max(int(rng.lognormvariate(mu=5.545, sigma=0.8)), 8), 1536)  # e^5.545 ~ 256
        output_len = min(1 + int(rng.expovariate(1 / 200)), max_model_len - prompt_len)
        requests.append(Request(seq_id, prompt_len, output_len))
    return requests


def simulate_paged(requests: list[Request], num_blocks: int, block_size: int) -> Stats:
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    watermark = int(WATERMARK_FRACTION * manager.num_total_blocks)
    waiting, running, stats = deque(requests), [], Stats()
    while waiting or running:
        start = time.process_time()
        decoded, preempted = [], False
        while running:
            request = running.pop(0)
            while not manager.allocate_slots(request.seq_id, request.computed, 1):
                victim = running.pop() if running else request
                manager.free(victim.seq_id)  # recompute: prompt and generated tokens are prefilled again
                victim.prompt_len += victim.generated
                victim.output_len -= victim.generated
                victim.computed = victim.generated = 0
                waiting.appendleft(victim)
                stats.preemptions += 1
                preempted = True
                if victim is request:
                    break
            else:
                decoded.append(request)
            stats.manager_calls += 1
        running = decoded
        while waiting and not preempted:  # as vLLM: no admissions in a step that had to preempt
            request = waiting[0]
            needed = -(-request.prompt_len // block_size)
            if manager.num_free_blocks - needed < watermark:
                break
            assert manager.allocate_slots(request.seq_id, 0, request.prompt_len)
            stats.manager_calls += 1
            running.append(waiting.popleft())
        stats.manager_seconds += time.process_time() - start
        for request in running:  # the forward pass: write the scheduled tokens, sample one each
            request.computed = request.prompt_len if request.computed == 0 else request.computed + 1
            request.generated += 1
        if waiting:
            held = manager.num_total_blocks - manager.num_free_blocks
            stats.steady_steps += 1
            stats.running_sum += len(running)
            stats.tokens_sum += sum(request.computed for request in running)
            stats.slots_sum += held * block_size
        for request in [r for r in running if r.generated >= r.output_len]:
            manager.free(request.seq_id)
            running.remove(request)
        stats.steps += 1
    assert manager.num_free_blocks == manager.num_total_blocks, "blocks leaked"
    return stats


def simulate_contiguous(requests: list[Request], max_seqs: int, max_model_len: int) -> Stats:
    waiting, running, stats = deque(requests), [], Stats()
    while waiting or running:
        while waiting and len(running) < max_seqs:
            running.append(waiting.popleft())
        for request in running:
            request.computed = request.prompt_len if request.computed == 0 else request.computed + 1
            request.generated += 1
        if waiting:
            stats.steady_steps += 1
            stats.running_sum += len(running)
            stats.tokens_sum += sum(request.computed for request in running)
            stats.slots_sum += max_seqs * max_model_len
        running = [request for request in running if request.generated < request.output_len]
        stats.steps += 1
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--reserved-seqs", type=int, default=8, help="memory = this many max_model_len reservations"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    num_blocks = 1 + args.reserved_seqs * args.max_model_len // args.block_size
    workload = make_workload(args.num_requests, args.max_model_len, args.seed)
    prompts = sum(r.prompt_len for r in workload) / len(workload)
    outputs = sum(r.output_len for r in workload) / len(workload)
    paged = simulate_paged(
        make_workload(args.num_requests, args.max_model_len, args.seed), num_blocks, args.block_size
    )
    contiguous = simulate_contiguous(workload, args.reserved_seqs, args.max_model_len)

    print(
        f"{args.num_requests} requests, mean prompt {prompts:.0f} / output {outputs:.0f} tokens, "
        f"max_model_len {args.max_model_len}, KV memory = {num_blocks - 1} blocks x {args.block_size} tokens"
    )
    print(f"{'steady state (requests waiting)':<36} {'paged':>10} {'contiguous':>11}")
    rows = [
        ("mean concurrent sequences", lambda s: f"{s.running_sum / max(s.steady_steps, 1):.1f}"),
        ("KV slots holding tokens", lambda s: f"{100 * s.tokens_sum / max(s.slots_sum, 1):.1f}%"),
        ("KV slots wasted", lambda s: f"{100 - 100 * s.tokens_sum / max(s.slots_sum, 1):.1f}%"),
        ("steps to drain the workload", lambda s: f"{s.steps}"),
        ("preemptions (recompute)", lambda s: f"{s.preemptions}"),
    ]
    for name, cell in rows:
        print(f"{name:<36} {cell(paged):>10} {cell(contiguous):>11}")
    gain = (paged.running_sum / max(paged.steady_steps, 1)) / (
        contiguous.running_sum / max(contiguous.steady_steps, 1)
    )
    print(f"concurrency at equal memory: {gain:.1f}x the contiguous reservation")
    per_call_us = 1e6 * paged.manager_seconds / max(paged.manager_calls, 1)
    print(f"block manager host time: {per_call_us:.2f} us per allocate_slots call (incl. preemption)")
    print(
        "reproduce: python scripts/bench_memory.py "
        f"--num-requests {args.num_requests} --max-model-len {args.max_model_len} "
        f"--block-size {args.block_size} --reserved-seqs {args.reserved_seqs} --seed {args.seed}"
    )


if __name__ == "__main__":
    main()
