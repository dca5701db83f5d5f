"""Run by tests/test_tensor_parallel.py in a process with several simulated CPU devices (XLA_FLAGS must be set
before JAX starts): greedy generation at each tensor_parallel_size given, printed as one JSON line.

  python tests/tensor_parallel_worker.py MODEL_PATH|default TP [TP ...]              # one generate per size
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

PROMPTS = [list(range(100, 120)), list(range(5, 40)), [7, 7, 7]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)


def per_device_bytes(array) -> list[int]:
    return sorted(shard.data.nbytes for shard in array.addressable_shards)


def placed_as_laid_out(runner, model: str | None) -> bool:
    """Each device's part of every weight, cut from the host arrays when the engine placed them, is that part of
    the whole weight in the step's layout."""
    whole = jax.device_get(runner.weights.layout(load_model(model, progress=False).params))
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


def run(model: str | None, tp: int) -> dict:
    ORBAX_READS.update(dict.fromkeys(ORBAX_READS, 0))
    try:
        llm = LLM(
            model,
            tensor_parallel_size=tp,
            quantization="none",  # a GGUF's blocks are kept on one device only: compare the dequantised forms
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
        "qkv_bytes": [qkv.nbytes, per_device_bytes(qkv)],
        "pool_bytes": [pool.nbytes, per_device_bytes(pool)],
        "orbax reads": dict(ORBAX_READS),
        "placed as laid out": placed_as_laid_out(runner, model),
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
        model = None if sys.argv[1] == "default" else sys.argv[1]
        print(json.dumps({tp: run(model, int(tp)) for tp in sys.argv[2:]}))
