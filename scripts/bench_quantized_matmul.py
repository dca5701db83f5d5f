"""The CPU kernels for quantized matrices against the dense bfloat16 kernel, same run: each of the embedded model's
matrices (SmolLM2-135M: qkv 576x960, o 576x576, gate_up 576x3072, down 1536x576, as 30-layer stacks, a layer picked
by index as the engine does; the LM head 576x49152) at several row counts, bfloat16 x, random weights. Forms:
bfloat16 panels (matmul.py), Q4_1 blocks (grouped_matmul.py, 4-bit codes, float16 scale and minimum per 32; the
LM head as Q8_0, as the embedded GGUF holds it) and int8 W8A8 (int8_matmul.py). Microseconds a layer's product,
the median of --repeats passes over every layer of the stack (so that the weights stream from memory as a step
reads them), and the ratio bfloat16 / form.

  python scripts/bench_quantized_matmul.py [--rows 1,16,64] [--repeats 20]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_kernels import median_seconds  # noqa: E402  (scripts/ is on the path when run)

from jpaged.models.quantized import quantize  # noqa: E402
from jpaged.pallas.cpu import grouped_matmul, int8_matmul  # noqa: E402
from jpaged.pallas.cpu import matmul as cpu_matmul  # noqa: E402
from jpaged.pallas.cpu.library import cpu_flags  # noqa: E402

MATRICES = {"qkv": (576, 960, 30), "o": (576, 576, 30), "gate_up": (576, 3072, 30), "down": (1536, 576, 30)}
MATRICES["lm_head"] = (576, 49152, 1)


def forms(rng, k: int, n: int, layers: int, head: bool) -> dict:
    """Each form's (product of x and a layer index, its packed weights)."""
    w = rng.standard_normal((layers, k, n)).astype(np.float32) * 0.05
    bits = 8 if head else 4
    codes = rng.integers(-127, 128, w.shape) if head else rng.integers(0, 16, w.shape)
    scale = rng.uniform(0.001, 0.01, (layers, k // 32, n)).astype(np.float16)
    grouped = grouped_matmul.pack(
        codes.astype(np.int8 if head else np.uint8), scale, np.zeros_like(scale), bits=bits
    )
    quantized = quantize(w, "int8")
    return {
        "bfloat16": (cpu_matmul.matmul, cpu_matmul.kernel_panels(jnp.asarray(w, jnp.bfloat16))),
        "Q8_0 blocks" if head else "Q4_1 blocks": (grouped_matmul.matmul, grouped),
        "int8 W8A8": (int8_matmul.matmul, int8_matmul.pack(quantized.values, quantized.scale)),
    }


def every_layer(product, x, packed, *, n: int, layers: int) -> jax.Array:
    """The product with each layer of the stack in turn (a sum of one output each, so none is skipped)."""

    def one(i, total):
        return total + product(x, packed, n, layer=i)[0, 0].astype(jnp.float32)

    return jax.lax.fori_loop(0, layers, one, jnp.float32(0))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    flags = sorted(cpu_flags() & {"avx2", "avx512_bf16", "amx_bf16", "amx_int8"})
    print(f"us a layer, median of {args.repeats} passes, bfloat16 x; CPU flags: {' '.join(flags)}")
    print("| matrix | rows | bfloat16 | Q4_1 / Q8_0 blocks | x | int8 W8A8 | x |")
    print("|---|---|---|---|---|---|---|")
    for name, (k, n, layers) in MATRICES.items():
        products = forms(rng, k, n, layers, name == "lm_head")
        for m in map(int, args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            times = {}
            for form, (product, packed) in products.items():
                fn = jax.jit(functools.partial(every_layer, product, n=n, layers=layers))
                times[form] = median_seconds(fn, [x, packed], args.repeats) * 1e6 / layers
            base, blocks, int8 = times.values()
            print(
                f"| {name} | {m} | {base:.0f} | {blocks:.0f} | {base / blocks:.2f} | {int8:.0f} | {base / int8:.2f} |"
            )
    print("\ncommand: python scripts/bench_quantized_matmul.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
