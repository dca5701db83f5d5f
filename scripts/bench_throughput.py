"""Offline throughput: jpaged's continuous batching vs HF transformers' static batching, same weights, same run.

Workloads (vLLM's random dataset, seeded; every request generates exactly its output length, as with ignore_eos):
  a  fixed:  N prompts x 128 tokens in, 128 tokens out
  b  mixed:  N prompts x 128 tokens in, output lengths uniform in 16..255 (136 with range ratio 0.88)
jpaged runs them as `jpaged bench throughput` does (jpaged.benchmarks.bench_throughput.run_offline). Static batching
runs the whole batch until its longest request is done; only each request's own output tokens count. Output
tokens/s = counted output tokens / wall time of the generation (warm-up excluded).

  python scripts/bench_throughput.py                 # both workloads, jpaged and HF, float32
  python scripts/bench_throughput.py --skip-hf --workloads b
  python scripts/bench_throughput.py --skip-hf --no-async-scheduling   # the serial loop
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jpaged.benchmarks.bench_throughput import run_offline  # noqa: E402
from jpaged.benchmarks.datasets import BenchRequest, requests_from  # noqa: E402

OUTPUT_LENGTHS = {"a": (128, 0.0), "b": (136, 0.88)}  # (random output len, range ratio)


def workload(name: str, num_prompts: int, input_len: int, seed: int) -> list[BenchRequest]:
    """Prompts drawn from a seed of this workload's own: with a shared one, b's prompts would be a's again and hit
    the prefix cache a left behind, skipping the prefill HF's static batching has to do."""
    output_len, ratio = OUTPUT_LENGTHS[name]
    dataset = argparse.Namespace(
        dataset="random",
        num_prompts=num_prompts,
        random_input_len=input_len,
        random_output_len=output_len,
        random_range_ratio=ratio,
        seed=seed * 256 + ord(name),
    )
    return requests_from(dataset)


def run_hf(model, requests: list[BenchRequest]) -> tuple[int, float]:
    import torch

    output_lens = [r.max_tokens for r in requests]
    ids = torch.tensor(
        [r.prompt for r in requests]
    )  # equal lengths: left padding is a no-op here, but the batch is static
    longest = max(output_lens)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=2,
        )
    return sum(output_lens), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", default="a,b")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--dtype", default="float32", help="jpaged's dtype (HF stays float32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="default: the platform's",
    )
    args = parser.parse_args()

    from jpaged import LLM

    start = time.perf_counter()
    llm = LLM(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=512,
        num_blocks=1 + args.num_prompts * (512 // 16),
        dtype=args.dtype,
        async_scheduling=args.async_scheduling,
    )
    warm = llm.metrics()["num_compilations"]
    print(f"jpaged start-up (load + warm-up of {warm} step shapes): {time.perf_counter() - start:.1f} s")
    hf = None
    if not args.skip_hf:
        import torch
        import transformers

        from jpaged.models.default_model import default_model_path

        path = default_model_path()
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    rows = []
    for name in args.workloads.split(","):
        requests = workload(name, args.num_prompts, args.input_len, args.seed)
        timings, seconds = run_offline(llm.engine, requests)
        row = {"workload": name, "jpaged": sum(t.output_tokens for t in timings) / seconds}
        if hf is not None:
            hf_tokens, hf_seconds = run_hf(hf, requests)
            row["hf"] = hf_tokens / hf_seconds
        rows.append(row)

    print(
        f"\n{args.num_prompts} prompts x {args.input_len} tokens in, jpaged {args.dtype}, CPU, async scheduling "
        f"{llm.engine.config.async_scheduling}; output tokens/s"
    )
    print("| workload | jpaged | HF static batching | ratio |")
    print("|---|---|---|---|")
    for row in rows:
        hf_rate = row.get("hf")
        hf_text = f"{hf_rate:.0f}" if hf_rate else "-"
        ratio = f"{row['jpaged'] / hf_rate:.2f}x" if hf_rate else "-"
        label = "a (128 out)" if row["workload"] == "a" else "b (16..255 out)"
        print(f"| {label} | {row['jpaged']:.0f} | {hf_text} | {ratio} |")
    print(f"\ncompilations after warm-up: {llm.metrics()['num_compilations'] - warm}")
    print("command: python scripts/bench_throughput.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
