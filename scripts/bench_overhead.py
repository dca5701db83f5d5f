"""Host time per engine step (schedule + batch preparation + output processing), device step excluded.

The model runner's device call is replaced by one whose random tokens are ready at once (async scheduling off), so what is timed is the
Python around it: the scheduler, the block manager, building the padded arrays and sampling inputs, appending
tokens, detokenising, stop checks, building outputs. Median of the decode steps of N running sequences.

Config per N: max_num_seqs=N, max_num_batched_tokens=max(512, N), max_model_len=512, num_blocks=1 + 32 N (every
sequence can reach max_model_len: nothing is preempted), the default model's vocabulary; N requests of 64 random
prompt tokens, max_tokens=250, ignore_eos, the given temperature. Every timed step runs all
N sequences as decodes (checked). Output kinds: FINAL_ONLY is what LLM.generate and the server's whole responses
use (one output per request, its text decoded once at the end); DELTA is what the server streams (an output per
request per step with only its new tokens and text, incremental detokenisation of every token); CUMULATIVE (every
output repeats everything so far) is vLLM's default for engine users who read outputs step by step.

  python scripts/bench_overhead.py                                   # N = 32, 128, 256; all three output kinds
  python scripts/bench_overhead.py --sizes 256 --temperature 1.0     # sampled rows
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(samples: list[float], fn):
    """`fn`, appending the seconds of each call to `samples`."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        samples.append(time.perf_counter() - start)
        return result

    return wrapper


def start_decoding(engine, size: int, params, rng: np.random.Generator) -> None:
    """`size` requests of 64 random prompt tokens, stepped until every one has its prompt computed (decoding)."""
    for i in range(size):
        engine.add_request(f"r{i}", list(map(int, rng.integers(100, 40000, 64))), params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < 64 for s in engine.scheduler.running):
        engine.step()


def stub_device(engine, rng: np.random.Generator) -> None:
    """Replace the engine's device step by one whose random tokens are ready at once."""
    from jpaged.runner.sampling_inputs import SamplerOutput
    from jpaged.runner.step_output import StepOutput

    class Ready:
        def __init__(self, num_rows: int) -> None:
            tokens = rng.integers(100, 40000, num_rows).astype(np.int32)
            self.output = StepOutput(SamplerOutput(tokens, None, None, None))

        def result(self) -> StepOutput:
            return self.output

    engine.runner.forward = lambda prepared: None
    engine.runner.sample = lambda sampling: Ready(sampling.temperature.shape[0])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="32,128,256")
    parser.add_argument("--output-kinds", default="FINAL_ONLY,DELTA,CUMULATIVE")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()

    from jpaged.config import EngineConfig
    from jpaged.engine.llm_engine import LLMEngine
    from jpaged.models.loader import load_model
    from jpaged.sampling_params import RequestOutputKind, SamplingParams

    model = load_model(None, progress=False)
    rng = np.random.default_rng(0)
    print(f"temperature {args.temperature}")
    print(
        "| running sequences | output kind | host ms / step | schedule | prepare | execute (stub) + outputs |"
    )
    print("|---|---|---|---|---|---|")
    for size in map(int, args.sizes.split(",")):
        for kind in args.output_kinds.split(","):
            config = EngineConfig(
                max_num_seqs=size,
                max_num_batched_tokens=max(512, size),
                max_model_len=512,
                num_blocks=1 + size * 32,
                enforce_eager=True,
                async_scheduling=False,
            )
            engine = LLMEngine(config, model=model)
            timings: dict[str, list[float]] = {"schedule": [], "prepare": []}

            engine.scheduler.schedule = timed(timings["schedule"], engine.scheduler.schedule)
            engine.runner.prepare = timed(timings["prepare"], engine.runner.prepare)
            stub_device(engine, rng)
            params = SamplingParams(
                max_tokens=250,
                temperature=args.temperature,
                ignore_eos=True,
                output_kind=RequestOutputKind[kind],
            )
            start_decoding(engine, size, params, rng)
            for name in timings:
                timings[name].clear()
            totals = []
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step()
                totals.append(time.perf_counter() - start)
                if len(engine.scheduler.running) != size or engine.scheduler.waiting:
                    raise RuntimeError(f"a timed step did not run all {size} sequences")
            total, schedule, prepare = (statistics.median(v) * 1e3 for v in (totals, *timings.values()))
            print(
                f"| {size} | {kind} | {total:.2f} | {schedule:.2f} | {prepare:.2f} | {total - schedule - prepare:.2f} |"
            )
    print("\ncommand: python scripts/bench_overhead.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
