"""A/B two versions of a C++ CPU kernel in one process, alternating runs, on the embedded model's shapes.

Between processes this shared 2-core machine's timings move by 10-50%; two builds of the same code timed in turns
in one process came within ~5% of each other with the default 11 repeats (more with fewer). Each source is
compiled alone and registered under a target of its own; a source may be a file
or REV:PATH from git.

  attention: the decode attention of every layer (SmolLM2: 30 layers, 9 query / 3 KV heads, head dim 64, blocks
             of 16), --seqs sequences of --context tokens each, pages in random order across the pool; with
             --query-len Q, each sequence's last Q tokens are its queries (a prefill chunk, causal)
  matmul:    SmolLM2's four layer matrices through 30 layers (one stacked panel array each, as the engine has
             them), x of --rows rows

  python scripts/ab_cpu_kernels.py attention 473c64e:jpaged/pallas/cpu_paged_attention.cc \\
      jpaged/pallas/cpu/paged_attention.cc
  python scripts/ab_cpu_kernels.py attention A.cc B.cc --shape 8,32,8,128 --seqs 32 --dtype bfloat16
  python scripts/ab_cpu_kernels.py attention A.cc B.cc --dtype bfloat16 --kv-dtype float8_e4m3fn  # fp8 pages
  python scripts/ab_cpu_kernels.py matmul c77f7a1~1:jpaged/pallas/cpu_matmul.cc jpaged/pallas/cpu/matmul.cc
  python scripts/ab_cpu_kernels.py matmul A.cc B.cc --march x86-64-v3     # the AVX2 paths, on an AVX-512 CPU
  python scripts/ab_cpu_kernels.py matmul 80e4529:jpaged/pallas/cpu/matmul.cc jpaged/pallas/cpu/matmul.cc \\
      --dtype bfloat16 --layout plain,kernel          # a revision before bfloat16 panels were stored paired

A REV:PATH source is built beside its revision's headers (panels.h, kernel.h); a path, with this checkout's.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_decode_step import BLOCK_SIZE, decode_batch  # noqa: E402  (scripts/ is on the path when run)
from bench_matmul import NUM_LAYERS  # noqa: E402
from bench_matmul import SHAPES as MATMUL_SHAPES  # noqa: E402

from jpaged.pallas.cpu import attention as cpu_attention  # noqa: E402
from jpaged.pallas.cpu import library as cpu_library  # noqa: E402
from jpaged.pallas.cpu import matmul as cpu_matmul  # noqa: E402

SYMBOLS = {"attention": "JpagedPagedAttention", "matmul": "JpagedMatmul"}
SCALED_TARGETS = set()  # attention sources that take the k_scale and v_scale operands


def build(
    source: str, kernel: str, index: int, workdir: Path, march: str = "native", defines: tuple[str, ...] = ()
) -> str:
    """Compiles `source` (a path or REV:PATH) and registers it as FFI target `ab<index>`."""
    if ":" in source and not Path(source).exists():
        rev, file = source.split(":", 1)
        folder = workdir / f"variant{index}"
        folder.mkdir()
        path = folder / Path(file).name
        # the source beside its revision's headers (panels.h, kernel.h...), which its quoted includes find first
        listed = subprocess.run(
            ["git", "ls-tree", "--name-only", rev, f"{Path(file).parent}/"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        for header in (name for name in listed if name.endswith(".h")):
            shown = subprocess.run(
                ["git", "show", f"{rev}:{header}"], capture_output=True, text=True, check=True
            )
            (folder / Path(header).name).write_text(shown.stdout)
        text = subprocess.run(["git", "show", source], capture_output=True, text=True, check=True).stdout
        path.write_text(text.replace('"cpu_kernel.h"', '"kernel.h"'))  # the header's name before pallas/cpu/
    else:
        path = Path(source)
    target = f"ab{index}"
    if "k_scale" in path.read_text():
        SCALED_TARGETS.add(target)
    library = workdir / f"variant{index}.so"
    cpu_library.compile_sources([path], library, march=march, extra=defines)
    cpu_library.register(library, {target: SYMBOLS[kernel]})
    return target


def attention_runs(targets, args, rng):
    """One jitted function per target: every layer's attention of the step (decode rows, or --query-len queries a
    sequence), each layer's output the next's queries."""
    num_layers, num_heads, num_kv_heads, head_dim = map(int, args.shape.split(","))
    dtype = jnp.dtype(args.dtype)
    if not 1 <= args.query_len <= args.context:
        raise SystemExit("--query-len must be between 1 and --context")
    batch, num_blocks = decode_batch(args.seqs, args.context, rng, args.pool_blocks)
    cache_shape = (num_layers, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    kv_dtype = jnp.dtype(args.kv_dtype or args.dtype)
    k = jnp.asarray(rng.standard_normal(cache_shape, np.float32), kv_dtype)
    v = jnp.asarray(rng.standard_normal(cache_shape, np.float32), kv_dtype)
    q = jnp.asarray(rng.standard_normal((args.seqs * args.query_len, num_heads, head_dim)), dtype)
    query_start = np.arange(args.seqs + 1, dtype=np.int32) * args.query_len
    tables, kv_lens, query_start, num_seqs = map(
        jnp.asarray, (batch.block_tables, batch.kv_lens, query_start, batch.num_seqs)
    )

    no_window = jnp.zeros((1,), jnp.int32)  # the window operand (sources before it took an attribute)
    unit_scales = (jnp.ones((1,), jnp.float32),) * 2  # k_scale, v_scale: for sources that take them

    def make(target):
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, q.dtype))
        scales = unit_scales if target in SCALED_TARGETS else ()

        def run(q, k, v):
            def layer(i, x):
                return call(
                    x, k, v, i.reshape(1), kv_lens, tables, query_start, num_seqs, no_window, *scales,
                    sm_scale=np.float32(head_dim**-0.5), soft_cap=np.float32(0.0),
                )  # fmt: skip

            return jax.lax.fori_loop(0, num_layers, layer, q)

        # The pools are arguments: captured by the function, they would be folded into it as constants.
        return jax.jit(run), (q, k, v)

    queries = f", {args.query_len} queries each" if args.query_len > 1 else ""
    label = f"{args.seqs} x {args.context}{queries}, {num_layers} layers, heads {num_heads}/{num_kv_heads}x{head_dim}"
    return [(f"{label}, {args.dtype} q, {kv_dtype} pages", [make(t) for t in targets])]


def matmul_runs(targets, args, rng):
    """Per row count, one jitted chain per target through every layer's four products, each reading the panels
    as --layout says (`kernel`: as this checkout's kernel_panels lays them out; `plain`: never paired)."""
    dtype = jnp.dtype(args.dtype)
    weights = [
        jnp.asarray(rng.standard_normal((NUM_LAYERS, k, n)) / np.sqrt(k), dtype) for k, n in MATMUL_SHAPES
    ]
    layouts = {
        "kernel": [cpu_matmul.kernel_panels(w) for w in weights],
        "plain": [cpu_matmul.pack(w) for w in weights],
    }

    def make(target, x, stacks):
        def product(h, panels, n, i):
            call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((h.shape[0], n), h.dtype))
            return call(h, panels, i.reshape(1), jnp.array([h.shape[0]], jnp.int32))

        def run(x, stacks):
            def layer(i, x):
                h = x
                for (k, n), panels in zip(MATMUL_SHAPES, stacks, strict=True):
                    h = product(h[:, :k], panels, n, i)
                return x + (1e-3 * h[:, : x.shape[1]]).astype(x.dtype)

            return jax.lax.fori_loop(0, NUM_LAYERS, layer, x)

        return jax.jit(run), (x, stacks)  # the weights as arguments, as in the engine

    runs = []
    for rows in map(int, args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((rows, MATMUL_SHAPES[0][0])), dtype)
        pair = [
            make(t, x, layouts[layout]) for t, layout in zip(targets, args.layout.split(","), strict=True)
        ]
        runs.append((f"{rows} rows, {args.dtype}", pair))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("kernel", choices=sorted(SYMBOLS))
    parser.add_argument("sources", nargs=2, metavar="SOURCE", help="A and B: a .cc path or REV:PATH")
    parser.add_argument("--repeats", type=int, default=11, help="runs of each, alternating")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--kv-dtype", choices=["float32", "bfloat16", "float8_e4m3fn"], help="default: --dtype"
    )
    parser.add_argument("--shape", default="30,9,3,64", help="attention: layers,heads,kv_heads,head_dim")
    parser.add_argument("--seqs", type=int, default=64, help="attention: sequences")
    parser.add_argument("--context", type=int, default=256, help="attention: tokens per sequence")
    parser.add_argument(
        "--query-len", type=int, default=1, help="attention: queries per sequence (its last tokens)"
    )
    parser.add_argument(
        "--pool-blocks",
        type=int,
        default=0,
        help="attention: blocks in the pool the pages are drawn from (default: just the ones needed)",
    )
    parser.add_argument("--rows", default="6,24,64,512", help="matmul: row counts")
    parser.add_argument(
        "--layout",
        default="kernel,kernel",
        help="matmul: A's and B's panels, `kernel` (as kernel_panels lays them out here) or `plain` (never paired)",
    )
    parser.add_argument(
        "--march", default="native", help="the CPU level both are built for (x86-64-v3: the AVX2 paths)"
    )
    args = parser.parse_args()
    if not cpu_library.compiles():
        raise SystemExit("the C++ CPU kernels cannot be built here")

    with tempfile.TemporaryDirectory() as workdir:
        # the attention kernel is built once per form: the one of --dtype and --kv-dtype
        fp8 = args.kv_dtype == "float8_e4m3fn"
        defines = cpu_attention.kernel(args.dtype, fp8).defines if args.kernel == "attention" else ()
        targets = [
            build(s, args.kernel, i, Path(workdir), args.march, defines) for i, s in enumerate(args.sources)
        ]
        rng = np.random.default_rng(0)
        runs = (attention_runs if args.kernel == "attention" else matmul_runs)(targets, args, rng)
        print(
            f"{args.kernel}: A = {args.sources[0]}, B = {args.sources[1]}; median of {args.repeats}, alternating"
        )
        print("| case | A ms | B ms | B / A | max abs diff |")
        print("|---|---|---|---|---|")
        for label, pair in runs:
            outputs = [np.asarray(fn(*inputs), np.float64) for fn, inputs in pair]  # also compiles
            times: list[list[float]] = [[], []]
            for _ in range(args.repeats):
                for (fn, inputs), spent in zip(pair, times, strict=True):
                    start = time.perf_counter()
                    jax.block_until_ready(fn(*inputs))
                    spent.append(time.perf_counter() - start)
            a, b = (1e3 * statistics.median(t) for t in times)
            diff = np.abs(outputs[0] - outputs[1]).max()
            print(f"| {label} | {a:.1f} | {b:.1f} | {b / a:.2f} | {diff:.1e} |")
    print("\ncommand: python scripts/ab_cpu_kernels.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
