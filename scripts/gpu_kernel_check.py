"""The GPU attention kernels compiled (not interpreted) against the float64 numpy oracle and the XLA reference: the
Triton kernel on tests/test_pallas_attention.py's GPU configurations, the Mosaic GPU kernel on
tests/test_mosaic_gpu_attention.py's (ragged steps of prefill chunks and decodes, GQA, sliding
window, soft cap, float32 / bfloat16 / float16, stale NaN in slots no sequence owns), through the public entry
point `jpaged.pallas.ragged_paged_attention(impl="pallas")`; then one step over a pool past 4 GiB per K/V array
with its pages at the top (64-bit offsets in the kernel's address arithmetic). Exits 1 on any failure.

  python scripts/gpu_kernel_check.py            # on a GPU
  python scripts/gpu_kernel_check.py --interpret --configs 1 --no-big-pool   # a CPU check of the plumbing
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_mosaic_gpu_attention as mosaic_cases  # noqa: E402  (the Mosaic GPU kernel's configurations)
import test_pallas_attention as cases  # noqa: E402  (the suite's configurations, random steps and oracle)

from jpaged.pallas import ragged_paged_attention  # noqa: E402
from jpaged.pallas.reference import ragged_paged_attention_reference  # noqa: E402


def check_config(cfg, interpret: bool, impl: str) -> bool:
    options = dict(
        sm_scale=cases.sm_scale(cfg), sliding_window=cfg.sliding_window, logits_soft_cap=cfg.soft_cap
    )
    kernel = jax.jit(functools.partial(ragged_paged_attention, **options, impl=impl, interpret=interpret))
    reference = jax.jit(functools.partial(ragged_paged_attention_reference, **options))
    rng = np.random.default_rng(zlib.crc32(cfg.id.encode()))
    start, errors = time.perf_counter(), []
    try:
        for stale in (None, None, np.nan):
            step = cases.draw_step(rng, cfg, stale_value=stale)
            args = cases.device_args(step, cfg.dtype)
            out = np.asarray(kernel(*args).astype(jnp.float32))
            if not np.isfinite(out).all():
                raise AssertionError("non-finite output" + (" (stale NaN leaked)" if stale else ""))
            expected = np.asarray(reference(*args).astype(jnp.float32))
            errors.append(
                max(
                    cases.relative_error(out, cases.oracle(cfg, args), step),
                    cases.relative_error(out, expected, step),
                )
            )
        ok = max(errors) < cases.TOLERANCE[cfg.dtype]
    except Exception as err:  # a Triton compile error lands here too
        ok, errors = False, [float("nan")]
        print(f"  {type(err).__name__}: {str(err)[:800]}")
    seconds = time.perf_counter() - start
    print(
        f"{'PASS' if ok else 'FAIL'} {impl:10} {cfg.id:48} max rel err {max(errors):.1e} (tol "
        f"{cases.TOLERANCE[cfg.dtype]:.0e}), {seconds:.1f} s with compiling",
        flush=True,
    )
    return ok


def check_big_pool(num_blocks: int = (1 << 18) + 1) -> bool:
    """31 decodes and one 300-token prefill chunk over a bfloat16 pool of 8.6 GB per K/V array (element offsets
    past 2**31), every page among the pool's last blocks; against the XLA reference."""
    rng = np.random.default_rng(1)
    heads, kv_heads, head_dim, block_size, context = 32, 8, 128, 16, 1000
    q_lens = [1] * 31 + [300]
    pages = -(-context // block_size)
    ids = rng.permutation(np.arange(num_blocks - len(q_lens) * pages, num_blocks)).astype(np.int32)
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = 1 << (int(query_start[-1]) - 1).bit_length()
    key = jax.random.key(0)
    fill = jax.jit(lambda pool, values: pool.at[ids].set(values), donate_argnums=0)
    shape = (num_blocks, block_size, kv_heads, head_dim)

    def pool(i: int) -> jax.Array:
        values = jax.random.normal(jax.random.fold_in(key, i), (len(ids), *shape[1:]), jnp.bfloat16)
        return fill(jnp.zeros(shape, jnp.bfloat16), values)

    args = [
        jax.random.normal(jax.random.fold_in(key, 3), (num_tokens, heads, head_dim), jnp.bfloat16),
        pool(1),
        pool(2),
        *map(jnp.asarray, (np.full(len(q_lens), context, np.int32), ids.reshape(len(q_lens), pages))),
        jnp.asarray(query_start),
        jnp.asarray([len(q_lens)], jnp.int32),
    ]
    options = dict(sm_scale=head_dim**-0.5)
    try:
        out = jax.jit(functools.partial(ragged_paged_attention, **options, impl="pallas"))(*args)
        expected = jax.jit(functools.partial(ragged_paged_attention_reference, **options))(*args)
        real = int(query_start[-1])
        out, expected = (np.asarray(x[:real], np.float32) for x in (out, expected))
        error = float(np.abs(out - expected).max() / np.abs(expected).max())
        ok = bool(np.isfinite(out).all()) and error < 1e-2
        print(
            f"{'PASS' if ok else 'FAIL'} pool of {args[1].nbytes / 2**30:.1f} GiB per K/V: rel err {error:.1e}"
        )
    except Exception as err:
        ok = False
        print(f"FAIL pool past 4 GiB: {type(err).__name__}: {str(err)[:800]}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--interpret", action="store_true", help="Pallas' interpreter (a CPU check of this script)"
    )
    parser.add_argument("--configs", type=int, default=None, help="only the first N GPU configurations")
    parser.add_argument("--no-big-pool", action="store_true")
    parser.add_argument("--impls", default="triton,mosaic_gpu", help="the GPU kernels to check")
    args = parser.parse_args()
    configs = [getattr(c, "values", (c,))[0] for c in cases.CONFIGS]
    suites = {
        "triton": [c for c in configs if c.kernel == "gpu"][: args.configs],
        "mosaic_gpu": mosaic_cases.CONFIGS[: args.configs],
    }
    results = [
        check_config(cfg, args.interpret, impl) for impl in args.impls.split(",") for cfg in suites[impl]
    ]
    if not args.no_big_pool:
        results.append(check_big_pool())
    print(
        f"kernel check on {jax.devices()[0].device_kind}: {results.count(False)} failure(s) of {len(results)}"
    )
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
