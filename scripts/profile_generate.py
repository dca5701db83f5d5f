"""Where a whole `LLM.generate` spends its device time: one run of compare.sh's workload under `jax.profiler`, the
trace's thunk events summed per kind (each less the thunks nested in it), prefill steps apart from decode steps.

The forward program's five per-layer custom calls are told apart by their order in a layer (QKV, attention, O,
gate/up, down); the one custom call a step makes once is the LM head; everything else is XLA's own ops. A step
whose custom calls take over `--long-ms` is counted as prefill. The profiler slows the run, so read the shares.

  python scripts/profile_generate.py                      # workload (a): 64 x 128 ids in, 128 out, float32
  python scripts/profile_generate.py --dtype bfloat16 --mixed
  python scripts/profile_generate.py --dtype bfloat16 --block-size 64
  python scripts/profile_generate.py --dtype bfloat16 --single    # compare.sh's single: 1 x 128 ids, 128 out
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jpaged  # noqa: E402

LAYER_CALLS = ("QKV", "attention", "O", "gate/up", "down")


def workload(mixed: bool, single: bool = False) -> tuple[list[list[int]], list[int]]:
    """compare.sh's workloads (../shared/bench/peers.py, seed 0): 64 x 128 random ids (special tokens and the
    vocabulary's tail avoided); 128 tokens out, or 16..256 with --mixed; one prompt with --single."""
    rng = random.Random((2 if mixed else 0 if single else 1) * 7919)
    prompts = [[rng.randrange(100, 49000) for _ in range(128)] for _ in range(1 if single else 64)]
    lengths = random.Random(1000)
    return prompts, [lengths.randint(16, 256) if mixed else 128 for _ in prompts]


def thunk_events(trace_dir: str) -> dict[tuple[str, str], list[dict]]:
    """The trace's complete events of XLA's thunks, by (program, run)."""
    path = next(Path(trace_dir).rglob("*.trace.json.gz"))
    with gzip.open(path) as trace:
        events = json.load(trace)["traceEvents"]
    runs = collections.defaultdict(list)
    for event in events:
        args = event.get("args") or {}
        if event.get("ph") == "X" and "hlo_module" in args:
            runs[(args["hlo_module"], args["run_id"])].append(event)
    return runs


def self_times(events: list[dict]) -> list[tuple[str, float]]:
    """(name, microseconds) per event less the events nested in it: a while or conditional thunk's event spans
    the thunks it runs, which have events of their own."""
    spent = {id(e): e["dur"] for e in events}
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[e["tid"]].append(e)
    for thread in by_thread.values():
        open_events: list[dict] = []
        for e in sorted(thread, key=lambda e: (e["ts"], -e["dur"])):
            while open_events and open_events[-1]["ts"] + open_events[-1]["dur"] <= e["ts"]:
                open_events.pop()
            if open_events:
                spent[id(open_events[-1])] -= e["dur"]
            open_events.append(e)
    return [(e["name"], spent[id(e)]) for e in events]


def xla_ops(events: list[dict]) -> collections.Counter:
    """Microseconds per XLA thunk of one program run (its custom calls left out), by HLO name."""
    spent = collections.Counter()
    for name, us in self_times(events):
        if not name.startswith("ffi_call"):
            spent[name] += us
    return spent


def kinds(events: list[dict]) -> collections.Counter:
    """Microseconds per kind of one program run."""
    calls = collections.Counter(e["name"] for e in events if e["name"].startswith("ffi_call"))
    first = {name: min(e["ts"] for e in events if e["name"] == name) for name in calls}
    per_layer = sorted((name for name, count in calls.items() if count > 1), key=first.get)
    names = dict(zip(per_layer, LAYER_CALLS, strict=False))
    spent = collections.Counter()
    for name, us in self_times(events):
        spent[names.get(name, "LM head") if name.startswith("ffi_call") else "XLA ops"] += us
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--mixed", action="store_true", help="workload (b): 16..256 tokens out")
    parser.add_argument("--single", action="store_true", help="one prompt (compare.sh's single)")
    parser.add_argument("--block-size", type=int, default=16, help="the engine's KV block size")
    parser.add_argument(
        "--long-ms", type=float, default=500.0, help="custom-call time that makes a prefill step"
    )
    parser.add_argument(
        "--ops", type=int, default=0, help="also list this many of XLA's costliest ops per phase"
    )
    args = parser.parse_args()

    llm = jpaged.LLM(max_model_len=2048, dtype=args.dtype, block_size=args.block_size)
    prompts, lengths = workload(args.mixed, args.single)

    def params(n: int) -> jpaged.SamplingParams:
        return jpaged.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    llm.generate(prompts[:4], [params(16)] * len(prompts[:4]))  # as compare.sh warms up
    with tempfile.TemporaryDirectory() as trace_dir:
        start = time.perf_counter()
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            llm.generate(prompts, [params(n) for n in lengths])
        wall = time.perf_counter() - start
        runs = thunk_events(trace_dir)

    totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    steps = collections.Counter()
    ops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for (program, _), events in runs.items():
        spent = kinds(events)
        custom = sum(us for kind, us in spent.items() if kind != "XLA ops")
        phase = "sampling" if "sample" in program else "prefill" if custom > args.long_ms * 1e3 else "decode"
        totals[phase] += spent
        ops[phase] += xla_ops(events)
        steps[phase] += 1
    print(f"{jax.devices()[0].device_kind}, {args.dtype}: {sum(lengths)} tokens out in {wall:.1f} s (traced)")
    print("| phase | programs run | kind | s | share of device time |")
    print("|---|---|---|---|---|")
    device = sum(sum(spent.values()) for spent in totals.values())
    for phase, spent in totals.items():
        for kind, us in spent.most_common():
            print(f"| {phase} | {steps[phase]} | {kind} | {us / 1e6:.2f} | {us / device:.0%} |")
    for phase, spent in ops.items():
        for name, us in spent.most_common(args.ops):
            print(f"{phase}: {name} {us / 1e6:.2f} s")
    print("\ncommand: python scripts/profile_generate.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
