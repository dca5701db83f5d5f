"""The requests both benchmarks send: vLLM's random dataset (random token ids, lengths spread by its range ratio),
or a JSONL file of {prompt, max_tokens}."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

RANDOM_TOKEN_IDS = (100, 10_000)  # random prompts' token ids: inside any real model's vocabulary


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (the random dataset's)
    prompt_tokens: int  # what the client counted; the server's usage replaces it when it reports one
    max_tokens: int


def add_dataset_args(parser: argparse.ArgumentParser, *, num_prompts: int, input_len: int) -> None:
    """The dataset's flags but --seed, which each benchmark names (bench throughput's is the engine's)."""
    parser.add_argument(
        "--dataset", default="random", help="'random', or a JSONL file of {prompt, max_tokens}"
    )
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--random-input-len", type=int, default=input_len)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len * (1 - r), len * (1 + r)], as vLLM's",
    )


def random_lengths(length: int, range_ratio: float, count: int, rng) -> list[int]:
    """vLLM's: integers uniform in [max(int(length * (1 - r)), 1), int(length * (1 + r))]."""
    low = max(int(length * (1 - range_ratio)), 1)
    return rng.integers(low, int(length * (1 + range_ratio)) + 1, count).tolist()


def requests_from(args: argparse.Namespace) -> list[BenchRequest]:
    """The dataset: random token ids of the random lengths, or the JSONL file's prompts, --num-prompts of them
    (a file shorter than that is cycled)."""
    import numpy as np

    if args.num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {args.num_prompts}")
    if args.dataset == "random":
        if args.random_input_len < 1 or args.random_output_len < 1:
            raise ValueError("random_input_len and random_output_len must be >= 1")
        if not 0 <= args.random_range_ratio < 1:
            raise ValueError(f"random_range_ratio must be in [0, 1), got {args.random_range_ratio}")
        rng = np.random.default_rng(args.seed)
        inputs, outputs = (
            random_lengths(length, args.random_range_ratio, args.num_prompts, rng)
            for length in (args.random_input_len, args.random_output_len)
        )
        return [
            BenchRequest(rng.integers(*RANDOM_TOKEN_IDS, n).tolist(), n, m)
            for n, m in zip(inputs, outputs, strict=True)
        ]
    path = Path(args.dataset)
    if not path.is_file():
        raise ValueError(f"dataset {args.dataset!r} is neither 'random' nor a file")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            row = json.loads(line)
            if not isinstance(row.get("prompt"), str):
                raise ValueError(f"dataset {path} line {number}: needs a 'prompt' string")
            rows.append(BenchRequest(row["prompt"], 0, int(row.get("max_tokens", args.random_output_len))))
    if not rows:
        raise ValueError(f"dataset {path} has no requests")
    return [rows[i % len(rows)] for i in range(args.num_prompts)]
