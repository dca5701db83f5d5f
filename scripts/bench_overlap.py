"""Async scheduling: a decode step's wall time beside its host time and its device time, all in one run.

Without overlap an engine step costs host + device (schedule, prepare, run, wait, process outputs); with
async scheduling the host schedules step N+1 and processes step N's tokens while step N+1 runs, so a step should
cost close to max(host, device). Per N running sequences, on one engine (the same compiled programs and state):
  host    the engine's step with the device call replaced by one that returns random tokens at once (the KV of
          those tokens is never written: later steps' values are garbage, their work the same)
  device  a decode step's compiled program run again and again on its inputs (packed each time), nothing else
  sync    a real step with async_scheduling off;  async: with it on
The four take turns in rounds of --steps steps each (drift between processes and over time hits all four), and
each figure is the median over all rounds.

Config per N: max_num_seqs=N, max_num_batched_tokens=max(512, N), max_model_len=512, num_blocks=1 + 32 N, the
default model cut to its first --layers layers (fewer layers: a shorter device step, host and device closer);
N requests of 64 random prompt tokens, ignore_eos, DELTA outputs (the server's streaming: most host work).

  python scripts/bench_overlap.py                         # N = 8, 64; 2 layers
  python scripts/bench_overlap.py --tiny --sizes 16,64    # host and device steps of similar length
  python scripts/bench_overlap.py --sizes 64 --layers 30  # the whole model: the device step dominates
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_overhead import start_decoding, stub_device  # noqa: E402


def cut_to_layers(model, num_layers: int):
    """The loaded model with only its first `num_layers` decoder layers (the stack's leading axis)."""
    import jax

    params = dict(model.params)
    params["layers"] = jax.tree_util.tree_map(lambda x: x[:num_layers], params["layers"])
    config = dataclasses.replace(model.config, num_layers=num_layers)
    return dataclasses.replace(model, config=config, params=params)


def tiny_random(model, rng: np.random.Generator, **dims):
    """A random model on the loaded model's vocabulary and tokenizer, by default 2 layers 64 wide (a device step
    of a few milliseconds, as long as the host's at a few dozen streams); `dims` override ModelConfig fields."""
    import jax

    from jpaged.models.llama import CausalLM, as_params

    tiny = dict(
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    config = dataclasses.replace(model.config, **{**tiny, **dims})
    shapes = as_params(CausalLM(config))
    params = jax.tree_util.tree_map(
        lambda x: (rng.standard_normal(x.shape) * 0.05 + (x == 1)).astype(np.float32), shapes
    )  # norms (filled with ones) stay near one
    return dataclasses.replace(model, config=config, params=params)


def decode_step_times(engine, steps: int, size: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        if len(engine.scheduler.running) != size or engine.scheduler.waiting:
            raise RuntimeError(
                f"a timed step did not run all {size} sequences: {len(engine.scheduler.running)} running, "
                f"{len(engine.scheduler.waiting)} waiting, {engine.metrics()}"
            )
    return times


def device_step_times(engine, steps: int) -> list[float]:
    """The next step's compiled program, run `steps` times more on its inputs (a serial step's: real tokens,
    so each run writes the KV slots it wrote the first time, with the same values)."""
    runner = engine.runner
    captured = {}
    forward, sample = runner.forward, runner.sample

    def capture_forward(prepared):
        captured["step"] = prepared
        return forward(prepared)

    def capture_sample(sampling):
        captured["sampling"] = sampling
        return sample(sampling)

    runner.forward, runner.sample = capture_forward, capture_sample
    engine.step()
    del runner.forward, runner.sample
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.dispatch(captured["step"], captured["sampling"]).result()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="8,64")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="a tiny random model instead (see tiny_random)")
    parser.add_argument("--steps", type=int, default=20, help="steps per round")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()

    from jpaged.config import EngineConfig
    from jpaged.engine.llm_engine import LLMEngine
    from jpaged.models.loader import load_model
    from jpaged.sampling_params import RequestOutputKind, SamplingParams

    rng = np.random.default_rng(0)
    loaded = load_model(None, progress=False)
    if args.tiny:
        model, name = tiny_random(loaded, rng), "tiny random model (2 layers, 64 wide, SmolLM2's vocabulary)"
    else:
        model, name = cut_to_layers(loaded, args.layers), f"default model, first {args.layers} layers"
    print(f"{name}; DELTA outputs")
    print(
        "| running sequences | host ms | device ms | host + device | max | sync ms / step | async ms / step |"
        " async / max |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for size in map(int, args.sizes.split(",")):
        config = EngineConfig(
            max_num_seqs=size,
            max_num_batched_tokens=max(512, size),
            max_model_len=512,
            num_blocks=1 + size * 32,
            async_scheduling=False,
        )
        engine = LLMEngine(config, model=model)
        # enough for every timed step, plus the lead the first prompts' sequences take during the prefills
        max_tokens = args.rounds * (3 * args.steps + 3) + 8 + 64 * size // config.max_num_batched_tokens
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        start_decoding(engine, size, params, rng)
        times = {"sync": [], "async": [], "device": [], "host": []}
        for _ in range(args.rounds):
            for mode in ("sync", "async"):
                engine.config.async_scheduling = mode == "async"
                engine.step()  # the switch: this step's outputs may come from the one before
                times[mode] += decode_step_times(engine, args.steps, size)
            engine.config.async_scheduling = False
            times["device"] += device_step_times(engine, args.steps)  # nothing in flight before or after
            stub_device(engine, rng)
            times["host"] += decode_step_times(engine, args.steps, size)
            del engine.runner.forward, engine.runner.sample
        host_ms, device_ms, sync_ms, async_ms = (
            statistics.median(times[k]) * 1e3 for k in ("host", "device", "sync", "async")
        )
        print(
            f"| {size} | {host_ms:.2f} | {device_ms:.2f} | {host_ms + device_ms:.2f} | "
            f"{max(host_ms, device_ms):.2f} | {sync_ms:.2f} | {async_ms:.2f} | "
            f"{async_ms / max(host_ms, device_ms):.2f} |"
        )
    print("\ncommand: python scripts/bench_overlap.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
