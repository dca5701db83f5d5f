"""The model's matrix products on CPU: XLA's dot vs the C++ matmul kernel (jpaged/pallas/cpu/matmul.py), same run.

Times the four weight matrices of every layer of the embedded model's shape (SmolLM2-135M: qkv 576x960, o 576x576,
gate_up 576x3072, down 1536x576; 30 layers, random weights, one jitted chain per row count) at several row counts
(a decode step's rows are its sequences, a prefill step's its tokens). XLA's side is the layout the engine used
before the kernel: each layer's matrices as separate arrays, stored [out, in] and contracted on both last axes
(the faster of XLA's options at small row counts). Median of --repeats.

--gated times the MLP the two ways the engine can run it: the kernel's gate_up product [rows, 3072] then XLA's
silu(gate) * up (models.products.act_and_mul), against the kernel's gated form, which computes the activation on the
sums as it stores them (the engine's choice where gate and up are multiples of 16 wide); the down product after
either.

  python scripts/bench_matmul.py                        # 8, 16, 64, 512 rows, float32
  python scripts/bench_matmul.py --rows 6,16 --dtype bfloat16
  python scripts/bench_matmul.py --rows 1,64,512 --dtype bfloat16 --gated
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_kernels import median_seconds  # noqa: E402  (scripts/ is on the path when run)

from jpaged.models.activations import act_and_mul  # noqa: E402
from jpaged.pallas.cpu import matmul as cpu_matmul  # noqa: E402

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (K, N) per layer, in order
NUM_LAYERS = 30


def chain(matmul):
    """x through every layer's four products (each output cut to the next K), as one jitted function."""

    def run(weights, x):
        for layer in weights:
            h = x
            for (k, n), w in zip(SHAPES, layer, strict=True):
                h = matmul(h[:, :k], w, n)
            x = x + 1e-3 * h
        return x

    return jax.jit(run)


def gated_table(weights: list, rows_list: list[int], dtype, repeats: int, rng) -> None:
    """Every layer's MLP in turn (gate_up, activation, down; each layer's x the last one's output plus a residual,
    as in the model): the unfused product and XLA's activation against the gated form."""
    (k, width), half = SHAPES[2], SHAPES[2][1] // 2
    gate_up, down = (jnp.stack([layer[i] for layer in weights]) for i in (2, 3))

    def mlp(activation):
        def run(w, down, x):
            for i in range(NUM_LAYERS):
                x = x + 1e-2 * cpu_matmul.matmul(activation(x, w, i), down, k, layer=i)  # stays finite
            return x

        return jax.jit(run)

    unfused = mlp(lambda x, w, i: act_and_mul(cpu_matmul.matmul(x, w, width, layer=i), (half, half), 1))
    gated = mlp(lambda x, w, i: cpu_matmul.gated_matmul(x, w, half, layer=i))
    panels, gated_panels, down_panels = (
        cpu_matmul.kernel_panels(gate_up),
        cpu_matmul.kernel_panels(gate_up, gated=True),
        cpu_matmul.kernel_panels(down),
    )
    print(f"\n{NUM_LAYERS} layers' MLP (gate_up {k}x{width}, activation, down), in turn; median of {repeats}")
    print("| rows | product + XLA activation ms | gated form ms | speed-up | max abs diff |")
    print("|---|---|---|---|---|")
    for rows in rows_list:
        x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
        unfused_s = median_seconds(unfused, (panels, down_panels, x), repeats)
        gated_s = median_seconds(gated, (gated_panels, down_panels, x), repeats)
        a, b = (
            np.asarray(f(w, down_panels, x), np.float64)
            for f, w in ((unfused, panels), (gated, gated_panels))
        )
        print(
            f"| {rows} | {1e3 * unfused_s:.2f} | {1e3 * gated_s:.2f} | {unfused_s / gated_s:.2f}x "
            f"| {np.abs(a - b).max():.1e} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="8,16,64,512")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--gated", action="store_true", help="also time gate_up's gated form")
    args = parser.parse_args()
    if not cpu_matmul.supports(args.dtype):
        raise SystemExit("the C++ CPU kernels could not be built here")

    rng = np.random.default_rng(0)
    dtype = jnp.dtype(args.dtype)
    weights = [
        [jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype) for k, n in SHAPES]
        for _ in range(NUM_LAYERS)
    ]
    transposed = [[w.T.copy() for w in layer] for layer in weights]  # [out, in]
    panels = [[cpu_matmul.kernel_panels(w) for w in layer] for layer in weights]
    xla = chain(lambda x, w, n: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))))
    kernel = chain(lambda x, w, n: cpu_matmul.matmul(x, w, n))
    flops_per_row = 2 * NUM_LAYERS * sum(k * n for k, n in SHAPES)
    nbytes = NUM_LAYERS * sum(k * n for k, n in SHAPES) * dtype.itemsize

    print(f"{NUM_LAYERS} layers x 4 matrices ({nbytes / 1e6:.0f} MB), {args.dtype}; median of {args.repeats}")
    print(
        "| rows | XLA dot ms | C++ kernel ms | speed-up | kernel GFLOP/s | kernel GB/s of weights | max rel. diff |"
    )
    print("|---|---|---|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((rows, 576)), dtype)
        xla_s = median_seconds(xla, (transposed, x), args.repeats)
        kernel_s = median_seconds(kernel, (panels, x), args.repeats)
        expected = np.asarray(xla(transposed, x), np.float64)
        diff = np.abs(np.asarray(kernel(panels, x), np.float64) - expected).max() / np.abs(expected).max()
        print(
            f"| {rows} | {1e3 * xla_s:.1f} | {1e3 * kernel_s:.1f} | {xla_s / kernel_s:.2f}x "
            f"| {rows * flops_per_row / kernel_s / 1e9:.0f} | {nbytes / kernel_s / 1e9:.1f} | {diff:.1e} |"
        )
    if args.gated:
        gated_table(weights, list(map(int, args.rows.split(","))), dtype, args.repeats, rng)
    print("\ncommand: python scripts/bench_matmul.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
