"""Decode steps of random-weight Llama models through jpaged's engine beside the HBM floor, then one engine's
warm-up time and offline throughput. Public entry points only (`LLM.from_params`, `generate_arrays`, `generate`).

A decode step's time is the engine's whole loop (host included): the time of a greedy `generate_arrays` of
--long tokens less that of --short tokens, over the difference (prefix caching off, so both prefill alike). The
floor is (weights + the step's KV read) / the copy bandwidth measured here (x + 1 over 2 GiB, read + write).

  python scripts/bench_gpu_decode.py --decode llama1b,llama8b --engine llama1b   # on a GPU (bfloat16)
  python scripts/bench_gpu_decode.py --decode llama8b --engine "" --attention triton,mosaic_gpu   # both kernels
  python scripts/bench_gpu_decode.py --decode tiny --engine tiny --batches 1,8   # a CPU check of the plumbing
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jpaged import LLM, SamplingParams
from jpaged.models.config import ModelConfig
from jpaged.models.llama import abstract_params

SHAPES = {  # architecture, vocabulary, hidden, MLP, layers, heads, KV heads, head dim, eps, rope theta, max len
    "llama1b": ModelConfig("llama", 128256, 2048, 8192, 16, 32, 8, 64, 1e-5, 500000.0, 131072, True),
    "llama8b": ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 500000.0, 131072),
    "tiny": ModelConfig("llama", 512, 64, 128, 2, 4, 2, 16, 1e-5, 10000.0, 4096, True),
}


class TokenIdsOnly:
    """The engine's tokenizer for token-id prompts with detokenize=False: nothing is ever decoded."""

    eos_token_id = None
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        raise ValueError("this benchmark sends token ids only")

    def decode(self, token_ids, skip_special_tokens: bool = False, **kwargs) -> str:
        return ""


def random_weights(config: ModelConfig, dtype, seed: int = 0) -> dict:
    """The model's state dict drawn on the device: norms at one, the rest normal / sqrt(fan-in)."""
    key = jax.random.key(seed)
    flat, tree = jax.tree_util.tree_flatten_with_path(abstract_params(config, dtype))
    leaves = []
    for i, (path, spec) in enumerate(flat):
        if "norm" in jax.tree_util.keystr(path):
            leaves.append(jnp.ones(spec.shape, dtype))
        else:
            draw = jax.jit(lambda k, s=spec: jax.random.normal(k, s.shape, s.dtype) * s.shape[-2] ** -0.5)
            leaves.append(draw(jax.random.fold_in(key, i)))
    return jax.tree_util.tree_unflatten(tree, leaves)


def copy_bandwidth(mib: int) -> float:
    x = jnp.zeros((mib << 20) // 4, jnp.float32)
    inc = jax.jit(lambda v: v + 1)
    jax.block_until_ready(inc(x))
    times = []
    for _ in range(10):
        start = time.perf_counter()
        jax.block_until_ready(inc(x))
        times.append(time.perf_counter() - start)
    return 2 * x.nbytes / statistics.median(times)


def timed_generate(llm: LLM, prompts: np.ndarray, max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    out = llm.generate_arrays(prompts, None, params)
    jax.block_until_ready(out.tokens)
    return time.perf_counter() - start


def decode_table(name: str, args, dtype, bandwidth: float, attention: str) -> None:
    config = SHAPES[name]
    batches = [int(b) for b in args.batches.split(",")]
    weights = random_weights(config, dtype)
    weight_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(weights))
    kv_token_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * jnp.dtype(dtype).itemsize
    llm = LLM.from_params(
        weights,
        config,
        TokenIdsOnly(),
        max_model_len=args.context + args.long + 16,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(max(batches), 2048),
        enable_prefix_caching=False,
        enforce_eager=True,  # only the shapes these batches meet compile, on the untimed first call
        attention_impl=attention,
    )
    rng = np.random.default_rng(0)
    print(
        f"\n{name}: {weight_bytes / 1e9:.2f} GB of weights ({jnp.dtype(dtype).name}), context {args.context}, "
        f"attention {attention}"
    )
    print("| seqs | step ms | floor ms | floor / step | tok/s |")
    print("|---|---|---|---|---|")
    for n in batches:
        prompts = [rng.integers(1, config.vocab_size, (n, args.context), dtype=np.int32) for _ in range(3)]
        timed_generate(llm, prompts[0], args.long)  # compiles this batch's shapes
        short, long = timed_generate(llm, prompts[1], args.short), timed_generate(llm, prompts[2], args.long)
        step = (long - short) / (args.long - args.short)
        floor = (weight_bytes + n * args.context * kv_token_bytes) / bandwidth
        print(
            f"| {n} | {step * 1e3:.3f} | {floor * 1e3:.3f} | {floor / step:.0%} | {n / step:.0f} |",
            flush=True,
        )
    del llm, weights


def engine_run(name: str, args, dtype) -> None:
    config = SHAPES[name]
    start = time.perf_counter()
    llm = LLM.from_params(
        random_weights(config, dtype),
        config,
        TokenIdsOnly(),
        max_model_len=args.prompt_len + args.output_len + 16,
        max_num_batched_tokens=2048,
    )
    metrics = llm.metrics()
    print(
        f"\n{name} engine: start {time.perf_counter() - start:.1f} s, warm-up {llm.engine.warmup_seconds:.1f} s "
        f"({metrics['num_compilations']} step shapes)"
    )
    rng = np.random.default_rng(1)
    prompts = [
        list(map(int, rng.integers(1, config.vocab_size, args.prompt_len))) for _ in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = args.requests * args.output_len
    print(
        f"{args.requests} requests x ({args.prompt_len} in, {args.output_len} out), greedy: {seconds:.2f} s, "
        f"{generated / seconds:.0f} generated tok/s; compilations after warm-up: "
        f"{llm.metrics()['num_compilations'] - metrics['num_compilations']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--decode", default="llama1b,llama8b", help="shapes for the decode-step table ('' none)"
    )
    parser.add_argument("--engine", default="llama1b", help="shape for the engine run ('' none)")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument(
        "--attention",
        default="pallas",
        help="attention kernels for the decode table, each its own table "
        "(pallas: the device's choice; triton, mosaic_gpu: that GPU kernel)",
    )
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--short", type=int, default=4)
    parser.add_argument("--long", type=int, default=36)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    device = jax.devices()[0]
    bandwidth = copy_bandwidth(256 if device.platform == "cpu" else 2048)
    print(f"{device.device_kind}: copy bandwidth {bandwidth / 1e9:.0f} GB/s (x + 1, read + write)")
    for name in filter(None, args.decode.split(",")):
        for attention in args.attention.split(","):
            decode_table(name, args, dtype, bandwidth, attention)
    if args.engine:
        engine_run(args.engine, args, dtype)
    print("command: python scripts/bench_gpu_decode.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
