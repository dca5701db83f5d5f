"""Where a decode step's time goes: the whole step, the step without attention, attention alone, and the cost of
only reading the step's K/V pages, on the embedded model (its real weights, every layer), same run.

For S sequences of `context` cached tokens each (pages scattered over the pool), it times (median of --repeats),
for each matmul and attention implementation asked for:
  step          `forward` with the engine's attention for this backend (cache donated, as the engine runs it)
  no attention  the same step with attention replaced by the identity: matmuls, norms, RoPE, KV writes, LM head
  attention     the attention of all layers alone (layer scan, random queries)
  KV read       XLA gathers of exactly those K/V pages, summed and nothing else: the memory traffic attention
                cannot avoid, at the rate XLA's gathers reach on this device
and prints the attention share of the step, how far attention is from the KV-read floor, and the step's
memory-bandwidth floor: the bytes a decode step cannot avoid reading (every weight matrix once, the embedding
rows aside, and the step's K/V pages) at the copy bandwidth measured in the same run (a jitted `x + 1`).

  python scripts/bench_decode_step.py                          # 8 x 384 and 64 x 256 (S x context)
  python scripts/bench_decode_step.py --shapes 64x256 --repeats 9
  python scripts/bench_decode_step.py --attention reference,cpu   # XLA reference beside the C++ CPU kernel
  python scripts/bench_decode_step.py --matmul xla,cpu            # XLA's dots beside the C++ CPU matmul kernel
  python scripts/bench_decode_step.py --dtype float32,bfloat16     # both dtypes, same run
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernels import median_seconds  # noqa: E402  (scripts/ is on the path when run)

from jpaged.models.llama import StepBatch, as_stored, forward, init_kv_cache  # noqa: E402
from jpaged.models.loader import load_model  # noqa: E402
from jpaged.models.params import param_stats  # noqa: E402
from jpaged.pallas import get_attention_fn, resolve_attention_impl  # noqa: E402
from jpaged.runner.weight_layout import choose_products  # noqa: E402

BLOCK_SIZE = 16
KV_READ_PAGES = 4


def decode_batch(
    num_seqs: int, context: int, rng: np.random.Generator, pool_blocks: int = 0
) -> tuple[StepBatch, int]:
    """One decode token per sequence after `context - 1` cached ones, each sequence's pages drawn at random from
    a pool of `pool_blocks` blocks (at least the ones needed; block 0 is the null block); returns the batch and
    the pool size."""
    pages = -(-context // BLOCK_SIZE)
    num_blocks = max(1 + num_seqs * pages, pool_blocks)
    drawn = rng.permutation(np.arange(1, num_blocks))[: num_seqs * pages]
    tables = drawn.astype(np.int32).reshape(num_seqs, pages)
    position = np.full(num_seqs, context - 1, np.int32)
    slots = tables[:, -1] * BLOCK_SIZE + position % BLOCK_SIZE
    batch = StepBatch(
        token_ids=rng.integers(100, 40000, num_seqs).astype(np.int32),
        positions=position,
        slot_mapping=slots.astype(np.int32),
        block_tables=tables,
        query_start=np.arange(num_seqs + 1, dtype=np.int32),
        kv_lens=np.full(num_seqs, context, np.int32),
        num_seqs=np.array([num_seqs], np.int32),
        logits_indices=np.arange(num_seqs, dtype=np.int32),
        num_logits=np.array([num_seqs], np.int32),
    )
    return batch, num_blocks


def identity_attention(q, *args, **kwargs):
    return q


def widened(pages: jax.Array) -> jax.Array:
    """float32 values of pages gathered as they are stored (bfloat16 as its 16-bit words)."""
    if pages.dtype == jnp.uint16:
        pages = jax.lax.bitcast_convert_type(pages, jnp.bfloat16)
    return pages.astype(jnp.float32)


def kv_read(k_cache, v_cache, tables):
    """Sum of every layer's K and V pages named in `tables`, four pages of each sequence at a time (the fastest
    of 1, 2, 4 and 16 on the 2-core CPU), padded with the null block 0. Pages are widened to float32 after the
    gather: XLA CPU gathers bfloat16 pages several times slower than their 16-bit words."""
    tables = jnp.pad(tables, ((0, 0), (0, -tables.shape[1] % KV_READ_PAGES)))

    def per_layer(total, layer):
        def per_chunk(chunk, total):
            pages = jax.lax.dynamic_slice_in_dim(tables, chunk * KV_READ_PAGES, KV_READ_PAGES, axis=1)
            k, v = (widened(pool[layer, pages]).sum((0, 1, 2)) for pool in (k_cache, v_cache))
            return total + k + v

        return jax.lax.fori_loop(0, tables.shape[1] // KV_READ_PAGES, per_chunk, total), None

    init = jnp.zeros(k_cache.shape[3:], jnp.float32)
    return jax.lax.scan(per_layer, init, jnp.arange(k_cache.shape[0]))[0]


def all_layers_attention(
    q, k_cache, v_cache, batch: StepBatch, *, attention, num_layers: int, sm_scale: float
):
    """The attention of every layer for the same queries, under a layer scan as in the model."""

    def per_layer(out, layer):
        out += attention(
            q,
            k_cache,
            v_cache,
            layer,
            batch.kv_lens,
            batch.block_tables,
            batch.query_start,
            batch.num_seqs,
            sm_scale=sm_scale,
        )
        return out, None

    return jax.lax.scan(per_layer, jnp.zeros_like(q), jnp.arange(num_layers))[0]


class DonatedStep:
    """`forward` as the engine runs it: the cache donated and replaced by the returned one every call."""

    def __init__(self, weights, config, attention, num_blocks: int, kv_dtype) -> None:
        products, self.params = weights
        step = functools.partial(forward, config=config, attention=attention, products=products)
        self.step = jax.jit(step, donate_argnums=1)
        self.kv_cache = init_kv_cache(config, num_blocks, BLOCK_SIZE, kv_dtype)

    def __call__(self, batch: StepBatch) -> jax.Array:
        logits, self.kv_cache = self.step(self.params, self.kv_cache, batch)
        return logits


def read_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes per second of reading a large array once (a jitted sum)."""
    x = jnp.ones(num_bytes // 4, jnp.float32)
    return x.nbytes / median_seconds(jax.jit(jnp.sum), [x], repeats)


def kv_dtype_for(dtype, attention_impl: str):
    """The pool's dtype as the runner stores it (a bfloat16 pool as its 16-bit words for the C++ kernel)."""
    return jnp.uint16 if attention_impl == "cpu" and dtype == jnp.bfloat16 else dtype


def streamed_weight_bytes(params: dict) -> int:
    """Bytes of every weight a decode step reads whole: all of them but an untied embedding table, whose rows
    are gathered."""
    total = param_stats(params)[1]
    if "lm_head" in params:
        total -= param_stats(params["embed"])[1]
    return total


def time_shape(
    weights, config, attention, impl: str, dtype, num_seqs: int, context: int, repeats: int
) -> dict[str, float]:
    """`weights`: (the matrix products, the params in their layout)."""
    rng = np.random.default_rng(0)
    batch, num_blocks = decode_batch(num_seqs, context, rng)
    kv_dtype = kv_dtype_for(dtype, impl)
    timings = {
        name: 1e3
        * median_seconds(DonatedStep(weights, config, attend, num_blocks, kv_dtype), (batch,), repeats)
        for name, attend in (("step", attention), ("no attention", identity_attention))
    }
    cache_shape = (config.num_layers, num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    k_cache, v_cache = (jnp.asarray(rng.standard_normal(cache_shape, np.float32), dtype) for _ in "kv")
    q = jnp.asarray(rng.standard_normal((num_seqs, config.num_heads, config.head_dim), np.float32), dtype)
    attend_all = jax.jit(
        functools.partial(
            all_layers_attention,
            attention=attention,
            num_layers=config.num_layers,
            sm_scale=config.head_dim**-0.5,
        )
    )
    pools = as_stored(k_cache, kv_dtype), as_stored(v_cache, kv_dtype)
    timings["attention"] = 1e3 * median_seconds(attend_all, (q, *pools, batch), repeats)
    timings["KV read"] = 1e3 * median_seconds(
        jax.jit(kv_read),
        (*(as_stored(pool, kv_dtype_for(dtype, "cpu")) for pool in (k_cache, v_cache)), batch.block_tables),
        repeats,
    )
    timings["KV bytes"] = 2 * config.num_layers * batch.block_tables.size * k_cache[0, 0].nbytes
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="8x384,64x256", help="S x context pairs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--attention", default="auto", help="attention_impl values to compare, comma-separated"
    )
    parser.add_argument(
        "--matmul",
        default="auto",
        help="comma-separated: xla (the stacked matrices, XLA's dots), cpu (panels, the C++ kernel), auto (the "
        "engine's choice)",
    )
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or both, comma-separated")
    parser.add_argument("--probe-mib", type=int, default=1024, help="array size for the bandwidth probe")
    args = parser.parse_args()

    bandwidth = read_bandwidth(args.probe_mib << 20, args.repeats)
    print(
        f"{jax.devices()[0].device_kind}; read bandwidth {bandwidth / 1e9:.1f} GB/s; median of {args.repeats}"
    )
    print(
        "| dtype | S x context | matmul | attention impl | step ms | floor ms | no attention | attention "
        "| KV read | attention share | attention / KV read |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype_name in args.dtype.split(","):
        dtype = jnp.dtype(dtype_name)
        model = load_model(None, dtype, progress=False)
        config = model.config
        layouts = {"auto": "auto", "xla": "stacked", "cpu": "panels"}
        matmuls = {}
        for name in args.matmul.split(","):
            products = choose_products(model.params, layouts[name], activation=config.hidden_activation)
            matmuls[name] = products, jax.device_put(products.layout(model.params))
        layout = dict(head_dim=config.head_dim, dtype=dtype)
        impls = [resolve_attention_impl(impl, **layout) for impl in args.attention.split(",")]
        for shape in args.shapes.split(","):
            num_seqs, context = map(int, shape.split("x"))
            for (matmul, weights), impl in itertools.product(matmuls.items(), impls):
                attention = get_attention_fn(
                    impl, num_kv_heads=config.num_kv_heads, block_size=BLOCK_SIZE, **layout
                )
                t = time_shape(weights, config, attention, impl, dtype, num_seqs, context, args.repeats)
                share = (t["step"] - t["no attention"]) / t["step"]
                rate = t["KV bytes"] / t["KV read"] / 1e6
                floor = 1e3 * (streamed_weight_bytes(weights[1]) + t["KV bytes"]) / bandwidth
                print(
                    f"| {dtype_name} | {num_seqs} x {context} | {matmul} | {impl} | {t['step']:.1f} "
                    f"| {floor:.1f} | {t['no attention']:.1f} | {t['attention']:.1f} "
                    f"| {t['KV read']:.1f} ({rate:.1f} GB/s) | {share:.0%} | {t['attention'] / t['KV read']:.1f}x |"
                )
    print("\ncommand: python scripts/bench_decode_step.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
