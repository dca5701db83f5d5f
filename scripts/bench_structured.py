"""Structured outputs, the grammar side (no engine): on the default model's tokenizer, per spec, the time of a
first-seen compile, of a cached one (a copy of the compiled matcher), and of one token's bitmask fill, median over
a generation driven by a stand-in sampler (the lowest allowed token, EOS when allowed), one row and a batch of 64.

  python scripts/bench_structured.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jpaged.models.default_model import default_model_path  # noqa: E402
from jpaged.models.loader import load_model  # noqa: E402
from jpaged.sampling_params import StructuredOutputsParams  # noqa: E402
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


def main() -> None:
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
    print("command: python scripts/bench_structured.py")
    compiler.shutdown()


if __name__ == "__main__":
    main()
