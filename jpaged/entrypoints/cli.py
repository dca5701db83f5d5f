"""The `jpaged` command: `generate`, `serve`, `bench`, `plan` and `convert`."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import types
import typing

from jpaged_server.cli import add_server_args

from jpaged import start_up_collector
from jpaged.benchmarks.bench_serve import add_bench_serve_args
from jpaged.benchmarks.bench_throughput import add_bench_throughput_args
from jpaged.benchmarks.plan_command import add_plan_args
from jpaged.config import EngineConfig

# Flags whose vLLM spelling differs from the field name, or that need a unit in their help.
_HELP = {
    "kv_cache_memory": "KV cache size in bytes on CPU",
    "swap_space": "GiB of host memory for swapped-out KV blocks",
    "num_blocks": "number of KV blocks (overrides memory-based sizing)",
    "runner": "generate, or pooling: serve embeddings (/v1/embeddings, LLM.embed) instead of generation",
    "quantization": "int8 or fp8: quantize the layer matrices at load (W8A8, activations quantised per token); "
    "none: dequantise a quantized checkpoint (a GGUF's blocks, held as stored by default)",
    "kv_cache_dtype": "auto (the model's dtype) or fp8 (= fp8_e4m3): the KV pool as float8 e4m3, twice the tokens",
    "convert": "embed: run a decoder as an embedding model, pooled as its sentence-transformers config says "
    "(else last token, normalised)",
    "speculative_config": 'vLLM\'s speculative_config as JSON: {"method": "ngram" or "suffix", '
    '"num_speculative_tokens": k, ...}; each decode step verifies k proposed tokens in one forward',
    "attention_impl": "auto, pallas (the device's kernel: on a GPU Mosaic GPU on Hopper and Blackwell where it fits, else "
    "Triton), mosaic_gpu, triton, cpu or reference (XLA)",
    "warmup": "full: compile every step program before serving; progressive (serve's default): serve once the "
    "smallest steps' programs are compiled, compile the rest in the background, steps capped to what is compiled",
    "enable_expert_parallel": "split a mixture of experts' experts whole over the --tensor-parallel-size devices "
    "(E / tp each; tokens move to them) instead of each expert's MLP",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, spelled as vLLM spells it (--max-model-len, --no-enable-prefix-caching)."""
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        if field.name == "model":
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = hints[field.name]
        if isinstance(kind, types.UnionType):
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=field.default, help=_HELP.get(field.name)
            )
        else:
            parser.add_argument(flag, type=kind, default=field.default, help=_HELP.get(field.name))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)
    }
    return EngineConfig(**values)


def add_distributed_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="one engine over several processes (jax.distributed; implied by JAX_COORDINATOR_ADDRESS): "
        "process 0 runs the engine, every other process follows it",
    )


def _join_processes(args: argparse.Namespace) -> bool:
    """With --distributed, join the process group; True for a follower, which must then only follow."""
    from jpaged.runner import multihost

    if not (args.distributed or multihost.distributed_requested()):
        return False
    return multihost.initialize_distributed() != 0


def _follow(config: EngineConfig) -> int:
    from jpaged.engine.follower import follow

    start_up_collector.resume()  # a follower serves no /ready to resume it at
    return follow(config.gpu_memory_utilization)


def _generate(args: argparse.Namespace) -> int:
    from jpaged.entrypoints.llm import LLM
    from jpaged.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    if _join_processes(args):
        return _follow(config)
    llm = LLM(**dataclasses.asdict(config))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    if args.no_chat_template or llm.tokenizer.chat_template is None:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    else:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    print(outputs[0].outputs[0].text)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from jpaged.models.checkpoint import save_checkpoint
    from jpaged.models.loader import load_model

    source = load_model(args.source, keep_blocks=not args.dequantize)
    save_checkpoint(args.destination, source.config, source.params, source.tokenizer)
    restored = load_model(args.destination)
    print(f"wrote orbax checkpoint {args.destination}")
    print(f"load time: {source.source.kind} {source.load_seconds:.2f} s, orbax {restored.load_seconds:.2f} s")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from jpaged_server.cli import serve

    config = engine_config_from_args(args)
    if _join_processes(args):
        return _follow(config)
    return serve(args, config)


def _bench_serve(args: argparse.Namespace) -> int:
    from jpaged.benchmarks.bench_serve import run_bench_serve

    return run_bench_serve(args)


def _bench_throughput(args: argparse.Namespace) -> int:
    from jpaged.benchmarks.bench_throughput import run_bench_throughput

    return run_bench_throughput(args, engine_config_from_args(args))


def _plan(args: argparse.Namespace) -> int:
    from jpaged.benchmarks.plan_command import run_plan

    return run_plan(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jpaged", description="PagedAttention LLM inference in JAX and Pallas"
    )
    parser.add_argument("--log-level", default="INFO")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate a completion for one prompt")
    generate.add_argument("prompt")
    generate.add_argument("--model", default=None, help="model path, GGUF file, orbax dir or hub id")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--no-chat-template", action="store_true", help="complete the raw prompt")
    add_engine_args(generate)
    add_distributed_arg(generate)
    generate.set_defaults(run=_generate, enforce_eager=True)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, help="model (default: the embedded SmolLM2)")
    add_server_args(serve)
    add_engine_args(serve)
    # A server turns ready once the smallest steps are compiled (EngineConfig.warmup); --warmup full waits for all.
    serve.set_defaults(warmup="progressive")
    add_distributed_arg(serve)
    serve.set_defaults(run=_serve)

    bench = commands.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="benchmark", required=True)
    bench_serve = kinds.add_parser(
        "serve", help="vllm bench serve's benchmark, against any OpenAI-compatible server"
    )
    add_bench_serve_args(bench_serve)
    bench_serve.set_defaults(run=_bench_serve)
    bench_throughput = kinds.add_parser(
        "throughput", help="vllm bench throughput's offline benchmark, in-process, with bench serve's figures"
    )
    add_bench_throughput_args(bench_throughput)
    add_engine_args(bench_throughput)
    bench_throughput.set_defaults(run=_bench_throughput)

    plan = commands.add_parser("plan", help="size a deployment from a sample of real traffic")
    add_plan_args(plan)
    plan.set_defaults(run=_plan)

    convert = commands.add_parser("convert", help="write an orbax checkpoint of a model for fast loading")
    convert.add_argument("source")
    convert.add_argument("destination")
    convert.add_argument(
        "--dequantize",
        action="store_true",
        help="write a quantized checkpoint's matrices as float (they are kept quantized by default)",
    )
    convert.set_defaults(run=_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "serve":
        args.model = args.model_tag  # the server resumes the collector once it is ready
    else:
        start_up_collector.resume()
    try:
        return args.run(args)
    except ValueError as err:
        print(f"jpaged: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
