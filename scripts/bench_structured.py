"""Structured outputs on the default model, two parts in one run.

The grammar side (no engine), on the default model's tokenizer, per spec: the time of a first-seen compile, of a
cached one (a copy of the compiled matcher), and of one token's bitmask fill, median over a generation driven by a
stand-in sampler (the lowest allowed token, EOS when allowed), one row and a batch of 64.

The engine side (--engine): one warm engine, greedy, --batch requests of --output-len tokens each after a random
--input-len-token prompt: an unconstrained batch against one where a quarter of the requests are constrained by a
JSON schema that cannot complete within --output-len tokens (so both batches generate the same tokens), the two
alternating --rounds times (median wall time of each); then the time to the first token of one request whose
schema the engine has never seen (compiled while it waits) against the same schema again (cached).

  python scripts/bench_structured.py                 # grammar side only
  python scripts/bench_structured.py --engine        # and the engine side
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jpaged.config import EngineConfig  # noqa: E402
from jpaged.engine.llm_engine import LLMEngine  # noqa: E402
from jpaged.models.default_model import default_model_path  # noqa: E402
from jpaged.models.loader import load_model  # noqa: E402
from jpaged.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from jpaged.structured import GrammarCompiler, allocate_bitmask, allowed_tokens, fill_bitmasks  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
SPECS = {
    "json_schema (nested)": StructuredOutputsParams(json=PERSON),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"[A-Z][a-z]{2,9}-\d{3}"),
    "choice (3)": StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
}


def fill_times(
    compiler: GrammarCompiler, spec: StructuredOutputsParams, eos: int, steps: int = 64
) -> list[float]:
    matcher = compiler.compile(spec).matcher()
    row = allocate_bitmask(1, matcher.vocab_size)[0]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        matcher.fill_bitmask(row)
        times.append(time.perf_counter() - start)
        allowed = np.flatnonzero(allowed_tokens(row, matcher.vocab_size))
        token = eos if eos in allowed else int(allowed[0])
        matcher.accept_token(token)
        if token == eos:
            break
    return times


def batch_fill_time(compiler: GrammarCompiler, spec: StructuredOutputsParams, rows: int = 64) -> float:
    grammar = compiler.compile(spec)
    matchers = [grammar.matcher() for _ in range(rows)]
    out = allocate_bitmask(rows, grammar.vocab_size)
    start = time.perf_counter()
    fill_bitmasks([(m, i) for i, m in enumerate(matchers)], out)
    return time.perf_counter() - start


# At least 40 words of three: longer than any --output-len the engine part uses, so a constrained request runs
# its full length as an unconstrained one does.
LONG_LIST = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 40}


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    """Wall time and output tokens of one batch, all requests added at once."""
    start = time.perf_counter()
    for i, (prompt, request_params) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"b{start}-{i}", prompt, request_params)
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(out.outputs[0].token_ids) for out in engine.step() if out.finished)
    return time.perf_counter() - start, tokens


def time_to_first_token(engine: LLMEngine, prompt: list[int], schema: dict) -> float:
    params = SamplingParams(
        max_tokens=1, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema)
    )
    start = time.perf_counter()
    engine.add_request(f"t{start}", prompt, params)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def watch_fills(engine: LLMEngine) -> list[bool]:
    """For each step with a constrained row from now on: whether its forward was still on the device when the
    host had filled the masks (the fill hidden behind it)."""
    hidden = []
    runner, inputs = engine.runner, engine.sampling.inputs

    def watched(rows, num_rows):
        tensors = inputs(rows, num_rows)
        if tensors.token_bitmask is not None:
            hidden.append(runner.forward_running)
        return tensors

    engine.sampling.inputs = watched
    return hidden


def engine_part(args: argparse.Namespace) -> None:
    engine = LLMEngine(EngineConfig(max_num_seqs=args.batch, enable_prefix_caching=False))
    warm = engine.metrics()["num_compilations"]
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, vocab - 100, args.input_len).tolist() for _ in range(args.batch)]
    free = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=args.output_len,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(json=LONG_LIST),
    )
    mixed = [constrained if i % 4 == 0 else free for i in range(args.batch)]
    run_batch(engine, prompts[:4], mixed[:4])  # compiles LONG_LIST once: the batches find it cached
    times: dict[str, list[float]] = {"unconstrained": [], "25% constrained": []}
    filled = 0.0  # seconds the engine loop spent filling bitmasks in the constrained batches
    hidden = watch_fills(engine)
    for _ in range(args.rounds):
        for name, params in (("unconstrained", [free] * args.batch), ("25% constrained", mixed)):
            before = engine.constrained.fill_seconds
            seconds, tokens = run_batch(engine, prompts, params)
            assert tokens == args.batch * args.output_len, (name, tokens)  # the same work in both
            times[name].append(seconds)
            filled += engine.constrained.fill_seconds - before
    base = statistics.median(times["unconstrained"])
    print(f"\n{args.batch} requests x {args.input_len} in / {args.output_len} out, median of {args.rounds}:")
    for name, runs in times.items():
        median = statistics.median(runs)
        rate = args.batch * args.output_len / median
        print(f"  {name:<16} {median:6.2f} s  {rate:6.1f} output tok/s  {median / base:.3f}x the time")
    constrained_time = sum(times["25% constrained"])
    print(
        f"  bitmask fill in the constrained batches: {1e3 * filled / args.rounds:.0f} ms a batch, "
        f"{100 * filled / constrained_time:.1f}% of their time; the forward still ran when the fill ended "
        f"in {sum(hidden)} of {len(hidden)} constrained steps"
    )
    first, cached = [], []
    for i in range(args.rounds):
        schema = dict(PERSON, properties={**PERSON["properties"], f"field_{i}": {"type": "string"}})
        first.append(time_to_first_token(engine, prompts[i], schema))
        cached.append(time_to_first_token(engine, prompts[i], schema))
    print(
        f"  time to first token, first-seen schema {1e3 * statistics.median(first):.0f} ms, "
        f"cached {1e3 * statistics.median(cached):.0f} ms (median of {args.rounds}, nested schema)"
    )
    print(f"  compilations after warm-up: {engine.metrics()['num_compilations'] - warm}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", action="store_true", help="also time the engine side")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tokenizer = load_model(str(default_model_path()), progress=False).tokenizer
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    start = time.perf_counter()
    compiler.compile(StructuredOutputsParams(regex="x"))  # llguidance's view of the tokenizer, built once
    print(f"tokenizer view (once per process): {1e3 * (time.perf_counter() - start):.0f} ms")
    print(f"{'spec':<22} {'compile ms':>10} {'cached ms':>10} {'fill us/token':>14} {'batch 64 ms':>12}")
    for name, spec in SPECS.items():
        start = time.perf_counter()
        compiler.compile(spec)
        first = time.perf_counter() - start
        start = time.perf_counter()
        compiler.compile(spec).matcher()
        cached = time.perf_counter() - start
        fill = statistics.median(fill_times(compiler, spec, tokenizer.eos_token_id))
        batch = batch_fill_time(compiler, spec)
        print(
            f"{name:<22} {1e3 * first:>10.2f} {1e3 * cached:>10.3f} {1e6 * fill:>14.0f} {1e3 * batch:>12.2f}"
        )
    compiler.shutdown()
    if args.engine:
        engine_part(args)
    print("command: python scripts/bench_structured.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
