"""`jpaged plan`: the capacity plan (capacity_plan.py) for a model and a memory budget, from a sample of real
traffic tokenised with the model's own tokenizer; tokens per character by script; the prefix-sharing doctor."""

from __future__ import annotations

import argparse
from pathlib import Path

import jax.numpy as jnp

from jpaged.config import KV_CACHE_DTYPES, NO_QUANTIZATION, QUANTIZATIONS

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="model (default: the embedded SmolLM2)")
    parser.add_argument("--traffic", required=True, help="JSONL of {prompt | messages, response}")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPE_BYTES),
        default="bfloat16",
        help="the model's dtype (and the KV cache's)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="fp8 (= fp8_e4m3): the KV cache in float8, one byte an element",
    )
    parser.add_argument(
        "--quantization",
        choices=(*QUANTIZATIONS, NO_QUANTIZATION),
        default=None,
        help="as `jpaged serve` takes it: a quantized checkpoint's matrices are counted as held, kept unless none",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache")
    parser.add_argument("--device-memory", type=int, default=None, help="bytes of one accelerator")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--concurrency", type=int, default=16, help="for the preemption risk")
    parser.add_argument("--chat-template", default=None)


def _holds_quantized_matrices(model: str | None) -> bool:
    """Whether the model's checkpoint ships quantized matrices the engine keeps (a GGUF, an HF checkpoint with a
    quantization_config, a quantized orbax checkpoint)."""
    from jpaged.models.checkpoint import holds_quantized_matrices
    from jpaged.models.loader import resolve_model
    from jpaged.models.weights import read_quantization_config

    source = resolve_model(model)
    if source.kind == "hf":
        return read_quantization_config(source.path) is not None
    return source.kind == "gguf" or holds_quantized_matrices(source.path)


def run_plan(args: argparse.Namespace) -> int:
    from jpaged.benchmarks.capacity_plan import capacity_plan
    from jpaged.benchmarks.text_scripts import tokens_by_script
    from jpaged.benchmarks.traffic import read_traffic
    from jpaged.core.kv_cache_sizing import determine_num_blocks, kv_bytes_per_token
    from jpaged.core.prefix_doctor import diagnose
    from jpaged.engine.llm_engine import DEFAULT_MAX_MODEL_LEN
    from jpaged.models.loader import load_model
    from jpaged.runner.tensor_parallel import check_tensor_parallel_size, tensor_parallel_config
    from jpaged.runner.weight_layout import held_weight_bytes

    if (args.kv_cache_memory is None) == (args.device_memory is None):
        raise ValueError(
            "give the memory as one of kv_cache_memory (bytes) or device_memory (bytes of one device)"
        )
    if args.concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {args.concurrency}")
    tp = args.tensor_parallel_size
    keep = args.quantization is None and _holds_quantized_matrices(args.model)  # as the engine keeps them
    # The weights stay on disk, but for a quantized checkpoint served as it is (its matrices read to count them).
    model = load_model(args.model, jnp.dtype(args.dtype), progress=False, lazy=not keep, keep_blocks=keep)
    mc, dtype_bytes = model.config, DTYPE_BYTES[args.dtype]
    check_tensor_parallel_size(tp, mc)
    kv_heads = tensor_parallel_config(tp, mc).num_kv_heads // tp
    kv_bytes = 1 if args.kv_cache_dtype != "auto" else dtype_bytes
    bytes_per_token = kv_bytes_per_token(mc.num_layers, kv_heads, mc.head_dim, kv_bytes)
    held = held_weight_bytes(model.params, mc.hidden_activation, args.quantization)
    weight_bytes = sum(held.values()) // tp
    num_blocks = determine_num_blocks(
        block_size=args.block_size,
        bytes_per_token=bytes_per_token,
        kv_cache_memory=args.kv_cache_memory,
        device_memory=args.device_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        weight_bytes=weight_bytes if args.device_memory else 0,
    )
    max_model_len = args.max_model_len or min(mc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    template = Path(args.chat_template).read_text() if args.chat_template else None
    traffic = read_traffic(Path(args.traffic), model.tokenizer, template)
    plan = capacity_plan(
        [r.total_tokens for r in traffic],
        num_blocks=num_blocks,
        block_size=args.block_size,
        bytes_per_token=bytes_per_token,
        max_model_len=max_model_len,
        concurrency=args.concurrency,
    )
    if args.device_memory:
        budget = (
            f"{args.device_memory:,} bytes x {args.gpu_memory_utilization} - {weight_bytes:,} bytes of weights per "
            "device (less the step's activation peak, which `jpaged serve` measures at start)"
        )
    else:
        budget = f"{args.kv_cache_memory:,} bytes"
    held_as = ", ".join(f"{n / 2**20:.1f} MiB {dtype}" for dtype, n in sorted(held.items()))
    print(
        f"model {model.source.path} ({mc.architecture}), weights held as {held_as}, KV cache in "
        f"{args.dtype if args.kv_cache_dtype == 'auto' else 'float8 e4m3'}, tensor_parallel_size {tp}"
    )
    print(f"KV cache memory per device: {budget}; traffic {args.traffic}\n")
    print("\n".join(plan.lines()))

    def count(text: str) -> int:
        return len(model.tokenizer.encode(text, add_special_tokens=False))

    print("\ntokens per character by script (each run of one script tokenised alone):")
    for label, (tokens, chars) in sorted(
        tokens_by_script([t for r in traffic for t in r.texts], count).items()
    ):
        print(f"  {label:<10} {tokens:>8,} tokens / {chars:>8,} characters = {tokens / chars:.3f}")
    finding = diagnose([r.prompt_ids for r in traffic], args.block_size)
    print(
        "\nprefix sharing: " + (finding.advice() if finding else "no varying head before a shared body found")
    )
    return 0
