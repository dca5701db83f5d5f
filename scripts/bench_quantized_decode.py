"""What holding the embedded model quantized buys in speed, same run: single-stream decode (a 128-token prompt, 64
tokens decoded) and batch throughput (32 prompts of 128 tokens, 64 tokens each) of the embedded SmolLM2-135M for
each configuration, engines built once and measured in turns (`--rounds`), the median reported with its ratio to
bfloat16 (the GGUF dequantised at load, `--quantization none`).

Configurations: bfloat16, the GGUF's Q4_1 / Q8_0 blocks as stored (the default), --quantization int8 (W8A8),
--kv-cache-dtype fp8.

  python scripts/bench_quantized_decode.py [--rounds 5] [--only blocks,bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = {
    "bfloat16": {"quantization": "none"},
    "Q4_1 blocks (default)": {},
    "int8 weights (W8A8)": {"quantization": "int8"},
    "fp8 KV cache, blocks": {"kv_cache_dtype": "fp8"},
}
PROMPT, DECODED, BATCH = 128, 64, 32


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="", help="comma-separated configuration names (prefixes)")
    args = parser.parse_args()
    from jpaged import LLM, SamplingParams
    from jpaged.pallas.cpu.library import cpu_flags

    chosen = {
        name: fields
        for name, fields in CONFIGS.items()
        if not args.only or any(name.startswith(p) for p in args.only.split(","))
    }
    engines = {
        name: LLM(dtype="bfloat16", max_model_len=512, max_num_seqs=BATCH, kv_cache_memory=2**30, **fields)
        for name, fields in chosen.items()
    }
    params = SamplingParams(max_tokens=DECODED, temperature=0.0, ignore_eos=True)
    prompts = [
        {"prompt_token_ids": [(7 * i + 13 * j) % 40000 + 100 for j in range(PROMPT)]} for i in range(BATCH)
    ]
    single: dict[str, list[float]] = {name: [] for name in engines}
    batch: dict[str, list[float]] = {name: [] for name in engines}
    for llm in engines.values():  # warm: the first request of each shape
        llm.generate(prompts[:1], params, use_tqdm=False)
    for _ in range(args.rounds):
        for name, llm in engines.items():
            start = time.perf_counter()
            llm.generate(prompts[:1], params, use_tqdm=False)
            single[name].append(DECODED / (time.perf_counter() - start))
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            batch[name].append(BATCH * DECODED / (time.perf_counter() - start))
    flags = sorted(cpu_flags() & {"avx2", "avx512_bf16", "amx_bf16", "amx_int8"})
    print(
        f"embedded SmolLM2-135M, bfloat16 activations, {args.rounds} rounds in turns; CPU flags: {' '.join(flags)}"
    )
    print("| configuration | single stream tok/s | vs bfloat16 | batch of 32 tok/s | vs bfloat16 |")
    print("|---|---|---|---|---|")
    base = {
        k: statistics.median(v["bfloat16"]) if "bfloat16" in v else None
        for k, v in (("s", single), ("b", batch))
    }
    for name in engines:
        s, b = statistics.median(single[name]), statistics.median(batch[name])
        ratio_s = f"{s / base['s']:.2f}x" if base["s"] else "-"
        ratio_b = f"{b / base['b']:.2f}x" if base["b"] else "-"
        print(f"| {name} | {s:.1f} | {ratio_s} | {b:.0f} | {ratio_b} |")
    print("\ncommand: python scripts/bench_quantized_decode.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
