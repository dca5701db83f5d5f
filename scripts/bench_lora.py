"""What serving LoRA adapters costs, same run, on the embedded SmolLM2-135M (bfloat16 activations, its GGUF blocks as
stored, or bfloat16 with --quantization none): batch throughput of 64 sequences (64-token prompts, 32 tokens decoded each) with no adapter on an engine
without LoRA (the baseline), and spread over 4 rank-16 adapters (all seven matrices targeted) on a LoRA engine
computing the deltas by the C++ matmul kernel (runner/lora_panels.py, the CPU's default: "panels") or by XLA in
each of models/lora.py's forms (dense, gather, grouped); the base-only batch on the LoRA engine too (what enabling
LoRA costs a request that uses none). Engines are built once and measured in turns
(`--rounds`), the median reported with its ratio to the baseline. Then `LLM.update_lora` of a rank-16 adapter: the
host reading its PEFT-named arrays, and the write into its device slot (median of 5).

Adapters are random (A ~ N(0, 1/in), B ~ N(0, 0.02)), written in PEFT's format (adapter_config.json,
adapter_model.safetensors).

  python scripts/bench_lora.py [--rounds 3] [--forms panels,dense,gather,grouped] [--quantization none]
  python scripts/bench_lora.py --shape llama-1b --forms panels    # random bfloat16 weights of Llama 3.2 1B's shape
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEQS, PROMPT, DECODED, ADAPTERS, RANK = 64, 64, 32, 4, 16
MODULES = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def adapter_tensors(config, seed: int) -> dict[str, np.ndarray]:
    """A rank-RANK adapter of every layer's seven matrices, PEFT-named (float32)."""
    rng = np.random.default_rng(seed)
    d, f, q, kv = (
        config.hidden_size,
        config.intermediate_size,
        config.num_heads * config.head_dim,
        config.num_kv_heads * config.head_dim,
    )
    shapes = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d)}
    shapes |= {"gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
    tensors = {}
    for layer in range(config.num_layers):
        for block, names in MODULES.items():
            for name in names:
                fan_in, fan_out = shapes[name]
                prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
                a = rng.normal(0, fan_in**-0.5, (RANK, fan_in))
                tensors[f"{prefix}.lora_A.weight"] = a.astype(np.float32)
                tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.02, (fan_out, RANK)).astype(np.float32)
    return tensors


def write_adapter(path: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    targets = [name for names in MODULES.values() for name in names]
    config = {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "target_modules": targets,
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "adapter_model.safetensors"))


def random_llama_1b():
    """What builds an engine over random bfloat16 weights of Llama 3.2 1B's shape (the embedded model's vocabulary,
    for its tokenizer): LoRA's cost beside a model whose layers outweigh the deltas' fixed costs."""
    import functools

    import jax
    import ml_dtypes

    from jpaged import LLM
    from jpaged.models.config import ModelConfig
    from jpaged.models.loader import load_model
    from jpaged.models.params import random_params

    config = ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    params = jax.tree_util.tree_map(
        lambda x: x.astype(ml_dtypes.bfloat16), random_params(config, dtype=np.float32)
    )
    tokenizer = load_model(None, progress=False).tokenizer
    return functools.partial(LLM.from_params, params, config, tokenizer)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--forms", default="panels,dense,gather,grouped")
    parser.add_argument(
        "--quantization", default=None, help="none: the base model in bfloat16, not its Q4_1 blocks"
    )
    parser.add_argument("--shape", default="embedded", choices=["embedded", "llama-1b"])
    args = parser.parse_args()
    from jpaged import LLM, LoRARequest, SamplingParams
    from jpaged.models.lora import XlaLoRA
    from jpaged.pallas.cpu.library import cpu_flags
    from jpaged.runner import lora_stacks, model_runner

    engine_args = dict(
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=SEQS,
        kv_cache_memory=2**30,
        quantization=args.quantization,
    )
    build = LLM if args.shape == "embedded" else random_llama_1b()
    engines = {"no LoRA": build(**engine_args)}
    for form in args.forms.split(","):  # the layout is chosen as the runner starts
        model_runner.lora_layout = (
            lora_stacks.lora_layout if form == "panels" else lambda *_, f=form: XlaLoRA(f)
        )
        engines[form] = build(enable_lora=True, max_loras=ADAPTERS, max_lora_rank=RANK, **engine_args)
    config = engines["no LoRA"].engine.model_config
    root = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    loras = []
    for i in range(ADAPTERS):
        write_adapter(root / f"a{i}", adapter_tensors(config, seed=i))
        loras.append(LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
    params = SamplingParams(max_tokens=DECODED, temperature=0.0, ignore_eos=True)
    prompts = [
        {"prompt_token_ids": [(7 * i + 13 * j) % 40000 + 100 for j in range(PROMPT)]} for i in range(SEQS)
    ]
    spread = [loras[i % ADAPTERS] for i in range(SEQS)]
    runs = {"no LoRA": ("no LoRA", None)}
    for form in engines.keys() - {"no LoRA"}:
        runs[f"{form}: 4 adapters"] = (form, spread)
        runs[f"{form}: base only"] = (form, None)
    for engine, lora in runs.values():  # warm: every shape's first run
        engines[engine].generate(prompts, params, use_tqdm=False, lora_request=lora)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (engine, lora) in runs.items():
            start = time.perf_counter()
            engines[engine].generate(prompts, params, use_tqdm=False, lora_request=lora)
            rates[name].append(SEQS * DECODED / (time.perf_counter() - start))
    flags = sorted(cpu_flags() & {"avx2", "avx512_bf16", "amx_bf16", "amx_int8"})
    weights = "bfloat16" if args.quantization == "none" else "Q4_1 blocks"
    model = (
        f"embedded SmolLM2-135M ({weights})"
        if args.shape == "embedded"
        else "Llama 3.2 1B's shape, random bfloat16"
    )
    print(f"{model}, {args.rounds} rounds in turns; CPU flags: {' '.join(flags)}")
    print(f"| run ({SEQS} sequences, {PROMPT}-token prompts, {DECODED} decoded) | tok/s | vs no LoRA |")
    print("|---|---|---|")
    base = statistics.median(rates["no LoRA"])
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"| {name} | {rate:.0f} | {rate / base:.2f}x |")

    llm = engines[next(iter(engines.keys() - {"no LoRA"}))]
    update = adapter_tensors(config, seed=99)
    host, write = [], []
    for _ in range(5):
        start = time.perf_counter()
        llm.update_lora("a0", update)
        middle = time.perf_counter()
        llm.engine.loras.load_pending(llm.engine.runner.write_lora)
        llm.engine.runner.lora.stacks["qkv"]["a"].block_until_ready()
        host.append(middle - start)
        write.append(time.perf_counter() - middle)
    print(
        f"\nupdate_lora of a rank-{RANK} adapter ({config.num_layers} layers x 7 matrices): "
        f"{statistics.median(host) * 1e3:.1f} ms host, {statistics.median(write) * 1e3:.1f} ms slot write"
    )
    print("\ncommand: python scripts/bench_lora.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
