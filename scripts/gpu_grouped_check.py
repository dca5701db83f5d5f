"""The GPU grouped kernel (jpaged/pallas/gpu_grouped_matmul.py) on a GPU: compiled, against a float64 oracle (on a
slice of columns) and XLA's dequantise-then-dot, then timed beside XLA's dequantise-then-dot and a bfloat16 dot of
the same shape (the bytes the kernel saves), median of `--repeats`. Run by scripts/gpu_check.sh; `--interpret
--small` checks the plumbing on a CPU (its times mean nothing).

  python scripts/gpu_grouped_check.py [--repeats 20] [--rows 1,16,256] [--interpret --small]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jpaged.models.grouped import GroupedMatrix, dequantize  # noqa: E402
from jpaged.pallas import gpu_grouped_matmul  # noqa: E402

# name -> (K, N, group, bits, codes): the shapes of tests/test_pallas_lowering.py's GROUPED_MATRICES
MATRICES = {
    "llama3-8b gate_up W4A16": (4096, 28672, 128, 4, "uint4"),
    "llama3-8b down W8A16": (14336, 4096, 128, 8, "int8"),
    "qwen3-8b qkv FP8 blocks": (4096, 6144, 128, 8, "float8"),
    "smollm2-135m Q4_1": (576, 1536, 32, 4, "uint4"),
}
ORACLE_COLUMNS = 256


def _matrix(k: int, n: int, group: int, bits: int, codes: str, rng) -> GroupedMatrix:
    draw = {
        "uint4": lambda: jnp.asarray(rng.integers(0, 16, (k, n)), jnp.uint8),
        "int8": lambda: jnp.asarray(rng.integers(-128, 128, (k, n)), jnp.int8),
        "float8": lambda: jnp.asarray(rng.standard_normal((k, n)) * 50, jnp.float8_e4m3fn),
    }[codes]
    scale = jnp.asarray(rng.random((k // group, n)) * 0.01 + 1e-4, jnp.float16)
    bias = jnp.asarray(rng.standard_normal((k // group, n)) * 0.01, jnp.float16)
    return GroupedMatrix(draw(), scale, bias, bits)


def _median_seconds(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rows", default="1,16,256")
    parser.add_argument("--interpret", action="store_true")
    parser.add_argument("--small", action="store_true", help="shapes cut to 1/8 (K) and 1/16 (N), for a CPU")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"device: {jax.devices()[0].device_kind}; bfloat16 activations; median of {args.repeats}")
    print(
        "| matrix | rows | vs float64 | vs XLA | kernel us | XLA dequantise-then-dot us | bfloat16 dot us |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, (k, n, group, bits, codes) in MATRICES.items():
        if args.small:
            k, n = max(k // 8 // group * group, group), max(n // 16, 64)
        matrix = _matrix(k, n, group, bits, codes, rng)
        packed = gpu_grouped_matmul.pack(matrix.codes, bits=bits, group=group)
        dense = dequantize(matrix, jnp.bfloat16)
        kernel = jax.jit(
            lambda x, p=packed, m=matrix: gpu_grouped_matmul.matmul(
                x, p, m.scale, m.bias, bits=m.bits, interpret=args.interpret
            )
        )
        xla = jax.jit(lambda x, m=matrix: jnp.dot(x, dequantize(m, jnp.bfloat16)))
        bf16 = jax.jit(lambda x, w=dense: jnp.dot(x, w))
        for rows in map(int, args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
            got = np.asarray(kernel(x), np.float64)
            w = np.asarray(matrix.codes[:, :ORACLE_COLUMNS], np.float64)
            w = w * np.repeat(np.asarray(matrix.scale[:, :ORACLE_COLUMNS], np.float64), group, 0)
            w += np.repeat(np.asarray(matrix.bias[:, :ORACLE_COLUMNS], np.float64), group, 0)
            oracle = np.asarray(x, np.float64) @ w
            vs_oracle = np.abs(got[:, :ORACLE_COLUMNS] - oracle).max() / np.abs(oracle).max()
            reference = np.asarray(xla(x), np.float64)
            vs_xla = np.abs(got - reference).max() / np.abs(reference).max()
            times = [_median_seconds(lambda f=f, x=x: f(x), args.repeats) * 1e6 for f in (kernel, xla, bf16)]
            print(
                f"| {name} | {rows} | {vs_oracle:.1e} | {vs_xla:.1e} | "
                + " | ".join(f"{t:.0f}" for t in times)
                + " |"
            )
    print("\ncommand: python scripts/gpu_grouped_check.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
