"""Decode time per step of a few concurrent requests, engines whose smallest token bucket differs, in turns.

A decode step of N requests pads its N tokens up to a compiled bucket (jpaged/runner/step_shapes.py). The matrix
kernels skip the padded rows; XLA's own ops (norms, SiLU, RoPE, residuals, the KV write) do not. This runs one
engine per `--min-tokens` value (the smallest bucket, step_shapes.MIN_TOKENS when the engine is built) on the
embedded model and times `--streams` greedy requests of compare.sh's first prompts (128 random ids), decode
only: a generate of 1 + `--tokens` tokens less one of 1 token. The engines take turns, `--rounds` times; the
figure is the median.

  python scripts/bench_small_steps.py                         # 1 stream, buckets 16, 4, 1, float32
  python scripts/bench_small_steps.py --dtype bfloat16 --streams 1,4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from profile_generate import workload  # noqa: E402  (scripts/ is on the path when run)

import jpaged  # noqa: E402
from jpaged.runner import step_shapes  # noqa: E402


def engine(min_tokens: int, dtype: str, max_streams: int) -> jpaged.LLM:
    """An engine built while the smallest bucket is `min_tokens` (StepShapes reads it when constructed)."""
    default = step_shapes.MIN_TOKENS
    step_shapes.MIN_TOKENS = min_tokens
    try:
        return jpaged.LLM(max_model_len=1024, dtype=dtype, num_blocks=64 * max_streams + 1, max_num_seqs=16)
    finally:
        step_shapes.MIN_TOKENS = default


def decode_ms_per_step(llm: jpaged.LLM, prompts: list[list[int]], tokens: int) -> float:
    def run(n: int) -> float:
        params = jpaged.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
        return time.perf_counter() - start

    return (run(1 + tokens) - run(1)) / tokens * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--min-tokens", default="16,4,1", help="smallest buckets to compare")
    parser.add_argument("--streams", default="1", help="concurrent requests, comma-separated")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per request")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    sizes = [int(s) for s in args.min_tokens.split(",")]
    streams = [int(s) for s in args.streams.split(",")]
    engines = {size: engine(size, args.dtype, max(streams)) for size in sizes}
    prompts, _ = workload(mixed=False)
    for llm in engines.values():
        decode_ms_per_step(llm, prompts[:1], 4)  # the first runs of each program
    times = {(n, size): [] for n in streams for size in sizes}
    for _ in range(args.rounds):
        for n in streams:
            for size, llm in engines.items():
                times[(n, size)].append(decode_ms_per_step(llm, prompts[:n], args.tokens))
    print(f"{args.dtype}, {args.tokens} decode tokens, median of {args.rounds} rounds in turns")
    print("| streams | smallest bucket | decode ms / step | rounds |")
    print("|---|---|---|---|")
    for (n, size), values in times.items():
        rounds = ", ".join(f"{v:.1f}" for v in values)
        print(f"| {n} | {size} | {statistics.median(values):.2f} | {rounds} |")
    print("\ncommand: python scripts/bench_small_steps.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
