"""The embedded model's engine with its weights and KV pool in transparent huge pages (jpaged/pallas/cpu/huge_pages.py)
beside the same engine in 4 KiB pages, in turns in one process.

Each round times, on each engine: compare.sh's workload (a) (64 prompts of 128 random token ids, 128 greedy tokens
each, EOS ignored) as output tokens per second, and one stream's decode (a generate of 129 tokens less one of 1
token, over 128). Every run draws fresh prompts (the prefix cache must not skip their prefill); the engines swap
order each round; the figures are medians.

  python scripts/bench_huge_pages.py                    # float32, 4 rounds
  python scripts/bench_huge_pages.py --dtype bfloat16 --rounds 6
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import jpaged
from jpaged.pallas.cpu import huge_pages

PROMPTS, PROMPT_LEN, OUT = 64, 128, 128


def engine(dtype: str, huge: bool) -> jpaged.LLM:
    advise = huge_pages.advise
    if not huge:
        huge_pages.advise = lambda arrays: 0
    try:
        return jpaged.LLM(max_model_len=2048, dtype=dtype)
    finally:
        huge_pages.advise = advise


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    engines = {"4 KiB pages": engine(args.dtype, False), "huge pages": engine(args.dtype, True)}
    rng = random.Random(0)

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(100, 40000) for _ in range(PROMPT_LEN)] for _ in range(n)]

    def timed(llm: jpaged.LLM, n: int, tokens: int) -> float:
        params = jpaged.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts(n), [params] * n, use_tqdm=False)
        return time.perf_counter() - start

    for llm in engines.values():
        timed(llm, 4, 16)
    figures = {(name, kind): [] for name in engines for kind in ("a", "single")}
    for round_ in range(args.rounds):
        order = list(engines.items())
        for name, llm in order if round_ % 2 == 0 else order[::-1]:
            figures[name, "a"].append(PROMPTS * OUT / timed(llm, PROMPTS, OUT))
            figures[name, "single"].append(OUT / (timed(llm, 1, OUT + 1) - timed(llm, 1, 1)))
            print(
                f"round {round_}: {name}: (a) {figures[name, 'a'][-1]:.1f} tok/s, "
                f"one stream {figures[name, 'single'][-1]:.1f} tok/s",
                flush=True,
            )
    median = {key: statistics.median(values) for key, values in figures.items()}
    print(
        f"\n| {args.dtype}, median of {args.rounds} | (a) tok/s | one stream, decode tok/s |\n|---|---|---|"
    )
    for name in engines:
        print(f"| {name} | {median[name, 'a']:.1f} | {median[name, 'single']:.1f} |")
    base, huge = "4 KiB pages", "huge pages"
    print(
        f"| ratio | {median[huge, 'a'] / median[base, 'a']:.3f} | "
        f"{median[huge, 'single'] / median[base, 'single']:.3f} |"
    )


if __name__ == "__main__":
    main()
