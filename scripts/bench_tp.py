"""Tensor parallelism on simulated CPU devices: a decode step's time at tp 1, 2 and 4, and the collectives XLA put
in the compiled step. The devices share the same 2 cores, so no speed-up can show here; what this shows is what
the split costs (the collectives, and the time they take when they do no useful work in parallel). On a GPU
machine with several devices the same command measures the real thing (XLA_FLAGS then changes nothing).

Config: a random Llama-shaped model on SmolLM2's vocabulary and tokenizer, --layers layers, hidden --hidden,
8 query heads and 4 KV heads of 64 (tp 4 divides both); N requests of 64 random prompt tokens, greedy,
ignore_eos, FINAL_ONLY; async scheduling off, so a step is one device step plus the host's part; max_num_seqs=N,
max_num_batched_tokens=max(256, N), max_model_len=512, num_blocks=1 + 32 N. Median over --steps decode steps.

  python scripts/bench_tp.py                    # N = 8, 64; tp 1, 2, 4 on 4 simulated devices
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from collections import Counter
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_overhead import start_decoding  # noqa: E402
from bench_overlap import decode_step_times, tiny_random  # noqa: E402

COLLECTIVE = re.compile(
    r"= \S+ (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\("
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="8,64")
    parser.add_argument("--tp", default="1,2,4")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    import jax

    from jpaged.config import EngineConfig
    from jpaged.engine.llm_engine import LLMEngine
    from jpaged.models.loader import load_model
    from jpaged.sampling_params import RequestOutputKind, SamplingParams

    rng = np.random.default_rng(0)
    dims = dict(
        num_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
    )
    model = tiny_random(load_model(None, progress=False), rng, **dims)
    devices = jax.devices()
    print(f"{len(devices)} {devices[0].platform} devices; random model {dims}")
    print("| running sequences | tp | step ms | step / tp 1 | collectives in the decode step |")
    print("|---|---|---|---|---|")
    for size in map(int, args.sizes.split(",")):
        baseline = None
        for tp in map(int, args.tp.split(",")):
            config = EngineConfig(
                max_num_seqs=size,
                max_num_batched_tokens=max(256, size),
                max_model_len=512,
                num_blocks=1 + size * 32,
                tensor_parallel_size=tp,
                async_scheduling=False,
            )
            engine = LLMEngine(config, model=model)
            params = SamplingParams(
                max_tokens=args.steps + 8 + 64 * size // config.max_num_batched_tokens,
                temperature=0.0,
                ignore_eos=True,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            start_decoding(engine, size, params, rng)
            step_ms = statistics.median(decode_step_times(engine, args.steps, size)) * 1e3
            baseline = baseline or step_ms
            num_tokens, _ = engine.runner.shapes.shape_for(size, size)  # the decode steps' bucket
            text = engine.runner.programs.step_texts(num_tokens)[0]
            counts = Counter(COLLECTIVE.findall(text))
            found = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())) or "none"
            print(f"| {size} | {tp} | {step_ms:.2f} | {step_ms / baseline:.2f} | {found} |")
    print("\ncommand: python scripts/bench_tp.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
