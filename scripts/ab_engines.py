"""Two configurations of the embedded model's engine, in turns in one process, on compare.sh's workloads.

Each round times, on each engine: (a) 64 prompts of 128 random token ids, 128 greedy tokens each; (b) the same
prompts count with U[16, 256] tokens out (EOS ignored, as compare.sh); one stream's decode (a generate of 129 tokens
less one of 1 token, over 128). Every run draws fresh prompts (the prefix cache must not skip their prefill); the
engines swap order each round; the figures are medians. A and B are `LLM` keyword arguments, `name=value` each
(values read as Python literals), on top of `max_model_len=2048` and --dtype.

  python scripts/ab_engines.py --a block_size=16 --b block_size=64 --dtype bfloat16 --rounds 3
"""

from __future__ import annotations

import argparse
import ast
import random
import statistics
import time

import jpaged

PROMPTS, PROMPT_LEN, OUT, MIXED_OUT = 64, 128, 128, (16, 256)


def overrides(text: str) -> dict:
    """`block_size=64,async_scheduling=False` as keyword arguments."""
    pairs = (item.split("=", 1) for item in text.split(",") if item)
    return {name: ast.literal_eval(value) for name, value in pairs}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--a", default="", help="A's LLM arguments, name=value,...")
    parser.add_argument("--b", default="", help="B's LLM arguments, name=value,...")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engines = {
        f"A {args.a}": jpaged.LLM(max_model_len=2048, dtype=args.dtype, **overrides(args.a)),
        f"B {args.b}": jpaged.LLM(max_model_len=2048, dtype=args.dtype, **overrides(args.b)),
    }
    rng = random.Random(0)

    def timed(llm: jpaged.LLM, outputs: list[int]) -> float:
        prompts = [[rng.randrange(100, 40000) for _ in range(PROMPT_LEN)] for _ in outputs]
        params = [jpaged.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for llm in engines.values():
        timed(llm, [16] * 4)
    kinds = ("(a)", "(b)", "one stream")
    figures = {(name, kind): [] for name in engines for kind in kinds}
    for round_ in range(args.rounds):
        workloads = {"(a)": [OUT] * PROMPTS, "(b)": [rng.randint(*MIXED_OUT) for _ in range(PROMPTS)]}
        order = list(engines.items())
        for name, llm in order if round_ % 2 == 0 else order[::-1]:
            for kind, lengths in workloads.items():
                figures[name, kind].append(sum(lengths) / timed(llm, lengths))
            figures[name, "one stream"].append(OUT / (timed(llm, [OUT + 1]) - timed(llm, [1])))
            done = ", ".join(f"{kind} {figures[name, kind][-1]:.1f}" for kind in kinds)
            print(f"round {round_}: {name}: {done}", flush=True)
    median = {key: statistics.median(values) for key, values in figures.items()}
    print(f"\n| {args.dtype}, median of {args.rounds}, tok/s | " + " | ".join(kinds) + " |")
    print("|---" * (len(kinds) + 1) + "|")
    for name in engines:
        print(f"| {name} | " + " | ".join(f"{median[name, k]:.1f}" for k in kinds) + " |")
    a, b = engines
    print("| B / A | " + " | ".join(f"{median[b, k] / median[a, k]:.3f}" for k in kinds) + " |")


if __name__ == "__main__":
    main()
