"""Benchmark ragged paged attention: the kernels for this backend (on GPU the Triton and the Mosaic GPU kernel, on TPU
its Pallas kernel, on CPU the C++ one) against the XLA reference.

Three steps at realistic sizes (32 query heads, 8 KV heads, head dim 128, block size 16): decode-only (256
sequences x 2k context), prefill-only (8 chunks of 1k new tokens after 1k of context) and mixed (248 decodes plus
one 1k-token chunk). For each it prints the time, the bytes the step must move at least (its own K/V pages, q
and out) per second, that rate as a share of the device's measured copy bandwidth, and the kernel's speed-up over
the reference.

  python scripts/bench_kernels.py                 # GPU or TPU: kernel and reference, full sizes
  python scripts/bench_kernels.py --small         # CPU: 1/8 of the sequences and context, reference and C++ kernel
  python scripts/bench_kernels.py --small --interpret   # CPU: also the GPU kernel in interpret mode (slow; it
                                                  # checks the plumbing, its time says nothing about a GPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.pallas import gpu, mosaic_gpu, mosaic_gpu_fit, tpu
from jpaged.pallas.cpu import attention as cpu_attention
from jpaged.pallas.cpu import library as cpu_library
from jpaged.pallas.reference import ragged_paged_attention_reference

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]

    def scaled(self, factor: int) -> Workload:
        """Every factor-th sequence, each with 1/factor of its context and new tokens (at least one)."""
        keep = slice(None, None, factor)
        shrink = lambda lens: tuple(max(1, n // factor) for n in lens[keep])  # noqa: E731
        q_lens = shrink(self.q_lens)
        kv_lens = tuple(max(q, kv) for q, kv in zip(q_lens, shrink(self.kv_lens), strict=True))
        return Workload(self.name, q_lens, kv_lens)


WORKLOADS = (
    Workload("decode", q_lens=(1,) * 256, kv_lens=(2048,) * 256),
    Workload("prefill", q_lens=(1024,) * 8, kv_lens=(2048,) * 8),
    Workload("mixed", q_lens=(1,) * 248 + (1024,), kv_lens=(2048,) * 248 + (2048,)),
)


def bucket(n: int, minimum: int) -> int:
    """The engine's shape buckets: powers of two from `minimum` up."""
    return max(minimum, 1 << (n - 1).bit_length())


def build_step(workload: Workload, dtype, seed: int = 0) -> tuple[list[jax.Array], int]:
    """Device arrays for one step (shuffled, non-contiguous blocks) and the bytes it must move at least."""
    rng = np.random.default_rng(seed)
    num_real = len(workload.q_lens)
    num_tokens, num_seq_slots = bucket(sum(workload.q_lens), 16), bucket(num_real, 8)
    table_width = math.ceil(max(workload.kv_lens) / BLOCK_SIZE)
    pages = [math.ceil(kv / BLOCK_SIZE) for kv in workload.kv_lens]
    num_blocks = 1 + sum(pages)
    block_tables = np.zeros((num_seq_slots, table_width), np.int32)
    free_blocks = iter(rng.permutation(np.arange(1, num_blocks)))
    for s, count in enumerate(pages):
        block_tables[s, :count] = [next(free_blocks) for _ in range(count)]
    kv_lens = np.zeros(num_seq_slots, np.int32)
    kv_lens[:num_real] = workload.kv_lens
    query_start = np.zeros(num_seq_slots + 1, np.int32)
    query_start[1 : num_real + 1] = np.cumsum(workload.q_lens)
    query_start[num_real + 1 :] = query_start[num_real]

    key = jax.random.key(seed)
    cache_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_pages = jax.random.normal(jax.random.fold_in(key, 1), cache_shape, dtype)
    v_pages = jax.random.normal(jax.random.fold_in(key, 2), cache_shape, dtype)
    q = jax.random.normal(jax.random.fold_in(key, 0), (num_tokens, NUM_Q_HEADS, HEAD_DIM), dtype)
    itemsize = jnp.dtype(dtype).itemsize
    kv_bytes = 2 * sum(workload.kv_lens) * NUM_KV_HEADS * HEAD_DIM * itemsize
    q_out_bytes = 2 * sum(workload.q_lens) * NUM_Q_HEADS * HEAD_DIM * itemsize
    arrays = [q, k_pages, v_pages, *map(jnp.asarray, (kv_lens, block_tables, query_start, [num_real]))]
    return arrays, kv_bytes + q_out_bytes


def relative_error(out: jax.Array, expected: jax.Array, num_real_tokens: int) -> float:
    """Max-norm difference over the step's real query rows, relative to the largest expected value."""
    out, expected = (np.asarray(x[:num_real_tokens], np.float32) for x in (out, expected))
    return float(np.abs(out - expected).max() / np.abs(expected).max())


def median_seconds(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes per second of a plain device copy (read + write) of a large array."""
    x = jnp.zeros(num_bytes // 4, jnp.float32)
    return 2 * x.nbytes / median_seconds(jax.jit(lambda a: a + 1), [x], repeats)


def kernels_for_backend(backend: str, dtype) -> dict[str, object]:
    """The Pallas kernels to time here: the TPU kernel, or both GPU kernels (Mosaic GPU where its tiles take the
    dtype; in interpret mode on CPU, where jax >= 0.11's interpreter runs it)."""
    if backend == "tpu":
        return {"pallas": tpu.ragged_paged_attention}
    kernels = {"triton": gpu.ragged_paged_attention}
    try:
        mosaic_gpu_fit.check_layout(NUM_Q_HEADS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, dtype)
        kernels["mosaic_gpu"] = mosaic_gpu.ragged_paged_attention
    except ValueError as err:
        print(f"mosaic_gpu: not timed ({err})")
    return {name: functools.partial(fn, interpret=backend == "cpu") for name, fn in kernels.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="1/8 of the sequences and context (for CPU)")
    parser.add_argument(
        "--interpret", action="store_true", help="on CPU, also time the kernel in interpret mode"
    )
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--copy-mib", type=int, default=1024, help="array size for the copy-bandwidth probe")
    args = parser.parse_args()

    backend = jax.default_backend()
    dtype = jnp.dtype(args.dtype)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    impls = {"reference": jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=scale))}
    if backend == "cpu" and cpu_library.available(cpu_attention.kernel(dtype)):
        impls["cpu"] = jax.jit(functools.partial(cpu_attention.ragged_paged_attention, sm_scale=scale))
    if backend != "cpu" or args.interpret:
        for name, kernel in kernels_for_backend(backend, dtype).items():
            impls[name] = jax.jit(functools.partial(kernel, sm_scale=scale))
    copy_mib = min(args.copy_mib, 256) if args.small else args.copy_mib
    bandwidth = copy_bandwidth(copy_mib << 20, args.repeats)

    print(f"backend={backend} device={jax.devices()[0].device_kind} dtype={dtype.name}")
    print(f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s ({copy_mib} MiB array, read + write)")
    print(
        f"{'step':8} {'T':>5} {'S':>4} {'impl':10} {'ms':>9} {'GB/s':>8} {'% copy':>7} {'speed-up':>8} "
        f"{'rel err':>8}"
    )
    for workload in WORKLOADS:
        workload = workload.scaled(8) if args.small else workload
        step, min_bytes = build_step(workload, dtype)
        times = {name: median_seconds(fn, step, args.repeats) for name, fn in impls.items()}
        expected = impls["reference"](*step)
        for name, seconds in times.items():
            rate = min_bytes / seconds
            speedup, error = "-", "-"
            if name != "reference":  # the compiled kernel checked against the reference on the same step
                speedup = f"{times['reference'] / seconds:.2f}x"
                error = f"{relative_error(impls[name](*step), expected, sum(workload.q_lens)):.1e}"
            print(
                f"{workload.name:8} {step[0].shape[0]:5} {step[3].shape[0]:4} {name:10} {seconds * 1e3:9.3f} "
                f"{rate / 1e9:8.1f} {100 * rate / bandwidth:6.1f}% {speedup:>8} {error:>8}"
            )
    flags = " ".join(f for f, on in (("--small", args.small), ("--interpret", args.interpret)) if on)
    print(f"reproduce: python scripts/bench_kernels.py {flags} --dtype {dtype.name} --repeats {args.repeats}")


if __name__ == "__main__":
    main()
