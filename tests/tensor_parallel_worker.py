"""Run by tests/test_tensor_parallel.py in a process with several simulated CPU devices (XLA_FLAGS must be set
before JAX starts): greedy generation at each tensor_parallel_size given, printed as one JSON line.

  python tests/tensor_parallel_worker.py MODEL_PATH|default TP [TP ...]              # one generate per size
  python tests/tensor_parallel_worker.py --quantization Q MODEL_PATH TP [TP ...]     # Q: none (the default),
                                              # int8, fp8, or kept (a quantized checkpoint's matrices as stored)

With --quantization, one device multiplies by XLA's dots as the split devices do (the CPU kernels' sums are held to
XLA's by their own tests; a W8A8 model's activation quantisation turns the last bit of a sum into a step), so what
the sizes' runs differ by is the split alone.
  python tests/tensor_parallel_worker.py --engine-features MODEL_PATH TP [TP ...]   # prefix caching,
                                                              # preemption (both modes), n > 1, beam search
"""

from __future__ import annotations

import json
import re
import sys

import jax
import numpy as np

from jpaged import LLM, SamplingParams
from jpaged.models import checkpoint
from jpaged.models.checkpoint import CheckpointedWeight
from jpaged.models.loader import load_model
from jpaged.models.products import MatrixProducts, is_whole_leaf
from jpaged.runner import model_runner
from jpaged.runner.weight_layout import tensor_parallel_products

PROMPTS = [list(range(100, 120)), list(range(5, 40)), [7, 7, 7]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)


def held_bytes(weight) -> list:
    """[bytes of the whole weight, each device's bytes of it (sorted)]: of a quantized one, of its arrays that are
    split (a per-tensor scale is on every device whole)."""
    arrays = [array for array in jax.tree_util.tree_leaves(weight) if array.shape[-2:] != (1, 1)]
    per_device: dict = {}
    for shard in (shard for array in arrays for shard in array.addressable_shards):
        per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return [sum(array.nbytes for array in arrays), sorted(per_device.values())]


def placed_as_laid_out(runner, model: str | None, keep_blocks: bool) -> bool:
    """Each device's part of every weight, cut from the host arrays (and quantized there) when the engine placed
    them, is that part of the whole weight in the step's layout."""
    loaded = load_model(model, progress=False, keep_blocks=keep_blocks)
    whole = jax.device_get(runner.weights.layout(loaded.params))
    placed = jax.tree_util.tree_leaves(runner.params)
    return all(
        np.array_equal(shard.data, expected[shard.index])
        for leaf, expected in zip(placed, jax.tree_util.tree_leaves(whole), strict=True)
        for shard in leaf.addressable_shards
    )


def count_orbax_reads() -> dict[str, int]:
    """From here on, how often an orbax checkpoint was restored into shards (restore_sharded) and how many of its
    leaves were read whole (CheckpointedWeight.__getitem__)."""
    counts = {"sharded restores": 0, "leaves read whole": 0}

    def counted(function, name):
        def call(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)

        return call

    checkpoint.restore_sharded = counted(checkpoint.restore_sharded, "sharded restores")
    CheckpointedWeight.__getitem__ = counted(CheckpointedWeight.__getitem__, "leaves read whole")
    return counts


ORBAX_READS = count_orbax_reads()


def xla_products(params: dict, *, activation: str, quantization: str | None) -> MatrixProducts:
    """What model_runner chooses on one device replaced with what the split devices multiply by."""
    return tensor_parallel_products(params, None, 1, quantization)


def run(model: str | None, tp: int, quantization: str = "none") -> dict:
    ORBAX_READS.update(dict.fromkeys(ORBAX_READS, 0))
    quantization = None if quantization == "kept" else quantization
    if quantization != "none":  # see the module's docstring
        model_runner.choose_products = xla_products
    try:
        llm = LLM(
            model,
            tensor_parallel_size=tp,
            quantization=quantization,
            max_model_len=128,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            num_blocks=40,
            enforce_eager=True,
        )
    except ValueError as err:
        return {"error": str(err)}
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    runner = llm.engine.runner
    qkv, pool = runner.params["layers"]["attn"]["qkv"], runner.kv_cache.k
    hlo = runner.programs.step_texts()[0]
    collectives = r"= (\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)\("
    return {
        "collectives": [[op, shape] for shape, op in re.findall(collectives, hlo)],
        "tokens": [o.token_ids for o in outputs],
        "logprobs": [[{str(k): v.logprob for k, v in step.items()} for step in o.logprobs] for o in outputs],
        "qkv_bytes": held_bytes(qkv),
        "pool_bytes": held_bytes(pool),
        "orbax reads": dict(ORBAX_READS),
        "placed as laid out": placed_as_laid_out(runner, model, keep_blocks=quantization is None),
        "held": sorted(
            {type(leaf).__name__ for leaf in jax.tree_util.tree_leaves(runner.params, is_leaf=is_whole_leaf)}
        ),
    }


def engine_features(model: str, tp: int, modes: tuple[str, ...] = ("recompute", "swap")) -> dict:
    """What the engine does around the step, each on an engine of `tp` devices: the tokens, and the counters
    that show the feature ran."""
    engine_args = dict(tensor_parallel_size=tp, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32)
    shared = list(range(200, 240))  # two full blocks every prompt shares
    prompts = [shared + [i, i + 1] for i in range(4)]
    results = {}
    llm = LLM(model, num_blocks=40, enforce_eager=True, **engine_args)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    results["prefix caching"] = [[o.outputs[0].token_ids for o in run] for run in (first, again)]
    results["prefix hits"] = llm.metrics()["prefix_cache_hits"]
    samples = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=8, ignore_eos=True)
    results["n=3"] = [
        [c.token_ids for c in o.outputs] for o in llm.generate(prompts[:2], samples, use_tqdm=False)
    ]
    beams = llm.beam_search(prompts[:2], beam_width=3, max_tokens=6, ignore_eos=True)
    results["beam search"] = [[c.token_ids for c in o.outputs] for o in beams]
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for mode in modes:  # 4 x 6 blocks wanted, 14 held: preemption
        small = LLM(
            model, num_blocks=14, preemption_mode=mode, swap_space=0.01, enforce_eager=True, **engine_args
        )
        outputs = small.generate(prompts, long, use_tqdm=False)
        results[f"preemption {mode}"] = [o.outputs[0].token_ids for o in outputs]
        results[f"preemptions {mode}"] = small.metrics()["num_preemptions"]
    return results


if __name__ == "__main__":
    if sys.argv[1] == "--engine-features":
        print(json.dumps({tp: engine_features(sys.argv[2], int(tp)) for tp in sys.argv[3:]}))
    else:
        args = sys.argv[1:]
        quantization = args[1] if args[0] == "--quantization" else "none"
        model, *sizes = args[2:] if args[0] == "--quantization" else args
        model = None if model == "default" else model
        print(json.dumps({tp: run(model, int(tp), quantization) for tp in sizes}))
