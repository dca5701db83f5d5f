"""A mixture of experts' decode step on the CPU against a dense model with the same active parameters, same run; and
the experts' grouped products against the dense-per-expert form and XLA's ragged_dot.

The MoE model is Qwen3-30B-A3B's shape with fewer layers (--layers; hidden 2048, 32 query and 4 KV heads of 128,
128 experts of 768, 8 a token) and a smaller vocabulary (--vocab: the LM head is the same matrix in both models,
so it only dilutes the comparison); the dense model is Qwen3 with the same attention and an MLP of 8 x 768 = 6144,
so a token multiplies the same number of weights in both. Random weights (normal, std 0.02: routing spread over
many experts), the engine's products and attention for this backend (`choose_products("auto")`: the C++ experts
kernel, expert_matmul.cc, on a CPU), S sequences of `--context` cached tokens each decoding one token; median of
--repeats. Ratios are within this run.

The MoE block alone (router, sort, grouped gate_up and down, combine) is then timed three ways at the same token
counts: the engine's products (the C++ experts kernel), XLA's ragged_dot (StackedProducts), and every expert on
every token (experts.dense_experts, the tests' reference).

  python scripts/bench_moe.py                       # 1 and 64 sequences, 2 layers, bfloat16
  python scripts/bench_moe.py --seqs 1,16,64 --layers 4 --dtype float32
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_decode_step import BLOCK_SIZE, DonatedStep, decode_batch, kv_dtype_for  # noqa: E402
from bench_kernels import median_seconds  # noqa: E402

from jpaged.models.config import ModelConfig  # noqa: E402
from jpaged.models.experts import dense_experts, route  # noqa: E402
from jpaged.models.llama import abstract_params  # noqa: E402
from jpaged.models.products import STACKED  # noqa: E402
from jpaged.pallas import get_attention_fn, resolve_attention_impl  # noqa: E402
from jpaged.pallas.cpu import matmul as cpu_matmul  # noqa: E402
from jpaged.runner.weight_layout import PanelProducts, choose_products  # noqa: E402

ATTENTION = dict(hidden_size=2048, num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6)
EXPERTS = dict(num_experts=128, num_experts_per_tok=8, expert_intermediate_size=768, norm_topk_prob=True)


def configs(layers: int, vocab: int) -> dict[str, ModelConfig]:
    shared = dict(
        vocab_size=vocab,
        num_layers=layers,
        rope_theta=1e6,
        max_position_embeddings=4096,
        qk_norm=True,
        **ATTENTION,
    )
    active = EXPERTS["num_experts_per_tok"] * EXPERTS["expert_intermediate_size"]
    return {
        "MoE": ModelConfig("qwen3_moe", intermediate_size=active, **shared, **EXPERTS),
        "dense": ModelConfig("qwen3", intermediate_size=active, **shared),
    }


def random_params(config: ModelConfig, dtype, seed: int = 0) -> dict:
    """Every matrix normal with std 0.02, norms 1: drawn on the device in `dtype` (a numpy draw of 2.4 G expert
    weights would take minutes)."""
    flat, tree = jax.tree_util.tree_flatten_with_path(abstract_params(config, dtype))
    keys = jax.random.split(jax.random.key(seed), len(flat))
    draw = jax.jit(lambda key, shape: 0.02 * jax.random.normal(key, shape, dtype), static_argnums=1)

    def leaf(key, path, x):
        norm = "norm" in jax.tree_util.keystr(path)
        return jnp.ones(x.shape, dtype) if norm else draw(key, x.shape)

    return tree.unflatten([leaf(key, path, x) for key, (path, x) in zip(keys, flat, strict=True)])


def engine_parts(config: ModelConfig, dtype):
    """(products, params in their layout, attention, its impl) as the engine would pick them here."""
    params = random_params(config, dtype)
    products = choose_products(params, "auto", activation=config.hidden_activation)
    laid_out = jax.block_until_ready(products.layout(params))
    impl = resolve_attention_impl("auto", head_dim=config.head_dim, dtype=dtype)
    attention = get_attention_fn(
        impl, num_kv_heads=config.num_kv_heads, block_size=BLOCK_SIZE, head_dim=config.head_dim, dtype=dtype
    )
    return products, laid_out, attention, impl


def step_ms(config: ModelConfig, dtype, seqs: list[int], context: int, repeats: int) -> list[float]:
    products, params, attention, impl = engine_parts(config, dtype)
    times = []
    for num_seqs in seqs:
        batch, num_blocks = decode_batch(num_seqs, context, np.random.default_rng(0))
        step = DonatedStep((products, params), config, attention, num_blocks, kv_dtype_for(dtype, impl))
        times.append(1e3 * median_seconds(step, (batch,), repeats))
        del step
    return times


def block_ms(config: ModelConfig, dtype, seqs: list[int], repeats: int) -> dict[str, list[float]]:
    """The first layer's MoE block at each token count, the three ways (see the module doc)."""
    mlp = random_params(replace(config, num_layers=1), dtype)["layers"]["mlp"]
    router, gate_up, down = mlp["router"][0], mlp["experts_gate_up"], mlp["experts_down"]
    kernel = PanelProducts(
        (),
        config.vocab_size,
        False,
        expert_widths=(gate_up.shape[-1], down.shape[-1]),
        experts_gated_form=True,
    )
    panels = cpu_matmul.kernel_panels(gate_up, gated=True), cpu_matmul.kernel_panels(down)  # [1, E, P, K, 16]
    stacked = (gate_up[0], down[0])
    ways = {  # (the block, its expert matrices: arguments, not constants folded into the program)
        "C++ experts kernel": (
            lambda x, w, e, live, g, d: kernel.mixture(x, w, e, g, d, 0, live, "silu"),
            panels,
        ),
        "XLA ragged_dot": (
            lambda x, w, e, live, g, d: STACKED.mixture(x, w, e, g, d, 0, live, "silu"),
            stacked,
        ),
        "dense per expert": (lambda x, w, e, live, g, d: dense_experts(x, w, e, g, d, "silu"), stacked),
    }
    times = {name: [] for name in ways}
    for num_tokens in seqs:
        x = jax.random.normal(jax.random.key(num_tokens), (num_tokens, config.hidden_size), dtype)
        weights, experts = route(x @ router, config)
        live = jnp.ones(num_tokens, bool)
        for name, (way, matrices) in ways.items():
            arguments = (x, weights, experts, live, *matrices)
            times[name].append(1e3 * median_seconds(jax.jit(way), arguments, repeats))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--seqs", default="1,64", help="sequence counts (a decode step's rows), comma-separated"
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    dtype = jnp.dtype(args.dtype)
    models = configs(args.layers, args.vocab)
    print(f"{jax.default_backend()}, {args.dtype}, {args.layers} layers, context {args.context}, median ms")
    steps = {
        name: step_ms(config, dtype, seqs, args.context, args.repeats) for name, config in models.items()
    }
    print(f"{'decode step':<22}" + "".join(f"{f'S={s}':>12}" for s in seqs))
    for name, times in steps.items():
        print(f"{name:<22}" + "".join(f"{t:>12.2f}" for t in times))
    ratios = [moe / dense for moe, dense in zip(steps["MoE"], steps["dense"], strict=True)]
    print(f"{'MoE / dense':<22}" + "".join(f"{r:>11.2f}x" for r in ratios))
    print(f"\n{'MoE block (1 layer)':<22}" + "".join(f"{f'T={s}':>12}" for s in seqs))
    for name, times in block_ms(models["MoE"], dtype, seqs, args.repeats).items():
        print(f"{name:<22}" + "".join(f"{t:>12.2f}" for t in times))


if __name__ == "__main__":
    main()
