"""Warm-up against compilations paid by live requests: how long warm-up takes and how many step programs it
compiles, then how many more an ordinary request mix compiles afterwards (each one a stall of a live request),
and the plain greedy decode step's time, which a shape-stable sampler must not slow.

The mix: logprobs 0-5 and 20, prompt_logprobs, penalties, logit_bias, stop strings, n=3, seeds, top-k/top-p/min-p,
bad_words, min_tokens, allowed_token_ids, beam search; each alone, then all together in one batch.

  python scripts/bench_warmup.py                          # cold (a fresh compilation cache dir)
  python scripts/bench_warmup.py --compilation-cache-dir /tmp/jpaged-cache   # run twice: cold, then warm
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIX = {
    "greedy": {},
    "logprobs 0": {"logprobs": 0},
    "logprobs 3": {"logprobs": 3},
    "logprobs 5": {"logprobs": 5},
    "logprobs 20": {"logprobs": 20},
    "prompt_logprobs 2": {"prompt_logprobs": 2},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2},
    "logit_bias": {"logit_bias": {42: 5.0, 1000: -100.0}},
    "stop strings": {"stop": ["\n\n", "."]},
    "n=3 sampled": {"n": 3, "temperature": 0.8, "seed": 7},
    "seeded top-k/top-p/min-p": {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "seed": 1},
    "bad_words": {"bad_words": ["the", " and"]},
    "min_tokens": {"min_tokens": 4},
    "allowed_token_ids": {"allowed_token_ids": list(range(100, 400))},
}
PROMPTS = ["The capital of France is", "Write a haiku about the sea:", "1, 2, 3, 4,", "def fibonacci(n):"]


def decode_step_ms(llm, SamplingParams, rounds: int = 3) -> float:
    """Mean seconds per generated step of 8 plain greedy requests decoding 64 tokens (min of a few rounds)."""
    best = float("inf")
    for r in range(rounds):
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        prompts = [f"{p} (round {r}, {i})" for i, p in enumerate(PROMPTS * 2)]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        best = min(best, (time.perf_counter() - start) / 64)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--compilation-cache-dir", default=None)
    args = parser.parse_args()

    from jpaged import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        compilation_cache_dir=args.compilation_cache_dir,
    )
    startup = time.perf_counter() - start
    warm = llm.metrics()["num_compilations"]
    print(
        f"start-up {startup:.1f} s, of which warm-up {llm.engine.warmup_seconds:.1f} s: {warm} step programs"
    )
    rows = []
    for name, fields in MIX.items():
        before = llm.metrics()["num_compilations"]
        llm.generate(PROMPTS, SamplingParams(max_tokens=8, **fields), use_tqdm=False)
        rows.append((name, llm.metrics()["num_compilations"] - before))
    before = llm.metrics()["num_compilations"]
    llm.beam_search(PROMPTS[:2], beam_width=3, max_tokens=6)
    rows.append(("beam search", llm.metrics()["num_compilations"] - before))
    before = llm.metrics()["num_compilations"]
    mixed = [SamplingParams(max_tokens=8, **fields) for fields in MIX.values()]
    llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(mixed))], mixed, use_tqdm=False)
    rows.append(("all of the above in one batch", llm.metrics()["num_compilations"] - before))
    print("| request | compilations after warm-up |\n|---|---|")
    for name, count in rows:
        print(f"| {name} | {count} |")
    total = llm.metrics()["num_compilations"] - warm
    print(f"total compilations after warm-up: {total}")
    print(f"plain greedy decode step, 8 requests: {decode_step_ms(llm, SamplingParams):.2f} ms")
    print("command: python scripts/bench_warmup.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
