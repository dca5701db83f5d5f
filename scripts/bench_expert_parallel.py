"""Expert parallelism's two forms of a mixture of experts (runner/expert_parallel.py) on simulated CPU devices,
beside tensor parallelism's split of each expert, at several step token counts T: the time of a stack of MoE
blocks (router, top-k, experts, residual) under one jit, the experts' weights placed as each splits them. The
devices share the machine's cores, so the figures compare the forms within one run (what each moves and computes
here), not a speed-up; ALL_TO_ALL_FROM_TOKENS takes the T from which the all-to-all form is the faster at
every T measured (None where it is not at the largest).

  * tp-split: every device holds each expert's share of F (param_shardings without expert_parallel), XLA's
    partitioning of the grouped products, an all-reduce of [T, D];
  * replicated: whole experts, E / tp a device; each device computes its own experts' pairs of all T tokens and
    an all-reduce sums them;
  * all-to-all: whole experts; each device sends its T / tp tokens' pairs to their experts' devices (capacity:
    all of them), gets the results back, combines, and an all-gather hands every device all T.

Random weights (std 0.05), a random router (uniform routing), float32; median of --repeats calls.

  python scripts/bench_expert_parallel.py          # 4 devices; T = 16, 64, 256, 1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", default="16,64,256,1024")
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--expert-size", type=int, default=128)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jpaged.models.products import StackedProducts
    from jpaged.runner.expert_parallel import ExpertParallelProducts

    mesh = Mesh(np.array(jax.devices()[: args.tp]), ("tp",))
    rng = np.random.default_rng(0)
    layers, d, f, e, k = args.layers, args.hidden, args.expert_size, args.experts, args.top_k
    router = (rng.standard_normal((layers, d, e)) * 0.05).astype(np.float32)
    gate_up = (rng.standard_normal((layers, e, d, 2 * f)) * 0.05).astype(np.float32)
    down = (rng.standard_normal((layers, e, f, d)) * 0.05).astype(np.float32)

    # Tensor parallelism reads each expert's gate|up columns grouped per device (fused_columns.py).
    grouped = np.arange(2 * f).reshape(2, args.tp, -1).transpose(1, 0, 2).reshape(-1)

    def placed(*specs, columns=slice(None)):
        weights = (router, gate_up[..., columns], down)
        return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(weights, specs, strict=True)]

    forms = {
        "tp-split": (
            StackedProducts(fused_groups=args.tp),
            placed(P(), P(None, None, None, "tp"), P(None, None, "tp"), columns=grouped),
        ),
        "replicated": (
            ExpertParallelProducts(StackedProducts(), mesh, None),
            placed(P(), P(None, "tp"), P(None, "tp")),
        ),
        "all-to-all": (
            ExpertParallelProducts(StackedProducts(), mesh, 0),
            placed(P(), P(None, "tp"), P(None, "tp")),
        ),
    }

    def blocks(products):
        def run(x, router, gate_up, down):
            live = jnp.ones(x.shape[0], bool)

            def block(x, weights):
                router, gate_up, down = weights
                probs = jax.nn.softmax(x @ router, axis=-1)
                top, experts = jax.lax.top_k(probs, k)
                top = top / top.sum(axis=-1, keepdims=True)
                return x + products.mixture(x, top, experts, gate_up, down, 0, live, "silu"), None

            return jax.lax.scan(block, x, (router, gate_up, down))[0]

        return jax.jit(run)

    devices = jax.devices()
    print(
        f"{args.tp} of {len(devices)} {devices[0].platform} devices; {layers} MoE blocks, D {d}, {e} experts of F {f}, top {k}"
    )
    print("| T | tp-split ms | replicated ms | all-to-all ms | all-to-all / replicated |")
    print("|---|---|---|---|---|")
    ratios = {}
    for tokens in map(int, args.tokens.split(",")):
        x = jax.device_put(rng.standard_normal((tokens, d)).astype(np.float32), NamedSharding(mesh, P()))
        times, outputs = {}, {}
        for name, (products, weights) in forms.items():
            run = blocks(products)
            outputs[name] = np.asarray(run(x, *weights))  # compiled, and the result to compare
            samples = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                run(x, *weights).block_until_ready()
                samples.append(time.perf_counter() - start)
            times[name] = statistics.median(samples) * 1e3
        spread = max(float(np.abs(outputs[n] - outputs["replicated"]).max()) for n in outputs)
        assert spread < 1e-4, f"the forms disagree by {spread}"
        ratio = ratios[tokens] = times["all-to-all"] / times["replicated"]
        print(
            f"| {tokens} | {times['tp-split']:.2f} | {times['replicated']:.2f} | {times['all-to-all']:.2f} | {ratio:.2f} |"
        )
    # The smallest T from which the all-to-all form is the faster at every T measured on (ALL_TO_ALL_FROM_TOKENS).
    measured = sorted(ratios)
    faster_from = next((t for i, t in enumerate(measured) if all(ratios[u] < 1 for u in measured[i:])), None)
    print(
        f"\nthe all-to-all form is the faster at every T from: {faster_from} (None: not at the largest measured)"
    )
    print("command: python scripts/bench_expert_parallel.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
