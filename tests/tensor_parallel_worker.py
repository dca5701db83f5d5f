"""Run by tests/test_tensor_parallel.py in a process with several simulated CPU devices (XLA_FLAGS must be set
before JAX starts): greedy generation at each tensor_parallel_size given, printed as one JSON line.

  python tests/tensor_parallel_worker.py MODEL_PATH|default TP [TP ...]              # one generate per size
  python tests/tensor_parallel_worker.py --quantization Q MODEL_PATH TP [TP ...]     # Q: none (the default),
                                              # int8, fp8, or kept (a quantized checkpoint's matrices as stored)

With --quantization, one device multiplies by XLA's dots as the split devices do (the CPU kernels' sums are held to
XLA's by their own tests; a W8A8 model's activation quantisation turns the last bit of a sum into a step), so what
the sizes' runs differ by is the split alone.
  python tests/tensor_parallel_worker.py --engine-features MODEL_PATH TP [TP ...]   # prefix caching,
                                      # preemption (both modes), n > 1, beam search, speculative decoding
  python tests/tensor_parallel_worker.py --enable-expert-parallel [--all-to-all] [--warm] MODEL_PATH TP [TP ...]
      # a mixture of experts' experts split whole over the devices; --all-to-all: every step's tokens moved in
      # the all-to-all form (else the default's); --warm: warm-up first, then sampled routing compiles nothing
  python tests/tensor_parallel_worker.py --mixture-forms TP        # expert parallelism's mixture in each form
      # against one device's, on skewed routings (see mixture_forms)
  python tests/tensor_parallel_worker.py --lora ADAPTER[,ADAPTER...] MODEL_PATH TP [TP ...]   # the prompts under
      # the base model and each LoRA adapter, in one batch
"""

from __future__ import annotations

import argparse
import json
import re

import jax
import numpy as np

from jpaged import LLM, SamplingParams
from jpaged.models import checkpoint
from jpaged.models.checkpoint import CheckpointedWeight
from jpaged.models.loader import load_model
from jpaged.models.products import MatrixProducts, is_whole_leaf
from jpaged.runner import expert_parallel, model_runner
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


# A collective in optimised HLO text: its result's shape (a tuple of them for some all-to-alls) and its op.
COLLECTIVE = re.compile(
    r"= (\(.*?\)|\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)\("
)


def expert_weights_moved(hlo: str, experts: list) -> list[str]:
    """The collectives of `hlo` with an operand or result shaped as an expert stack (`experts`: the stacks as
    placed), whole, a layer of it, or a device's part of either: what expert parallelism must never move."""
    shapes = set()
    for stack in experts:
        for shape in (stack.shape, stack.addressable_shards[0].data.shape):
            shapes |= {shape, shape[1:]}
    marks = {"[" + ",".join(map(str, shape)) + "]" for shape in shapes}
    return [line for line in hlo.splitlines() if COLLECTIVE.search(line) and any(m in line for m in marks)]


def run(
    model: str | None,
    tp: int,
    quantization: str = "none",
    expert_parallel: bool = False,
    warm: bool = False,
) -> dict:
    ORBAX_READS.update(dict.fromkeys(ORBAX_READS, 0))
    quantization = None if quantization == "kept" else quantization
    if quantization != "none":  # see the module's docstring
        model_runner.choose_products = xla_products
    try:
        llm = LLM(
            model,
            tensor_parallel_size=tp,
            enable_expert_parallel=expert_parallel,
            quantization=quantization,
            max_model_len=128,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            num_blocks=40,
            enforce_eager=not warm,
        )
    except ValueError as err:
        return {"error": str(err)}
    warmed_up = llm.metrics()["num_compilations"]
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    runner = llm.engine.runner
    qkv, pool = runner.params["layers"]["attn"]["qkv"], runner.kv_cache.k
    hlo = "\n".join(runner.programs.step_texts())
    result = {
        "collectives": [[op, shape] for shape, op in COLLECTIVE.findall(hlo)],
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
    mlp = runner.params["layers"]["mlp"]
    experts = [mlp[name] for name in ("experts_gate_up", "experts_down") if name in mlp]
    if experts:
        result["experts_bytes"] = [held_bytes(stack) for stack in experts]
        result["expert weights moved"] = expert_weights_moved(hlo, experts)
        sampled = SamplingParams(max_tokens=6, temperature=1.5, seed=1, ignore_eos=True)
        llm.generate(PROMPTS, sampled, use_tqdm=False)  # experts greedy decoding never takes
        result["compiled after warm-up"] = llm.metrics()["num_compilations"] - warmed_up
    return result


def mixture_forms(tp: int) -> dict[str, dict[str, float]]:
    """The largest difference between one device's mixture (StackedProducts) and expert parallelism's over `tp`
    devices in each form, by routing: every pair to the first device's experts (the most any device can take),
    every token to the last two experts, random, and random with each expert's biases (gpt-oss's); each with
    padding rows past the live ones."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jpaged.models.products import StackedProducts
    from jpaged.runner.expert_parallel import ExpertParallelProducts

    rng = np.random.default_rng(0)
    tokens, width, num_experts, size, k = 32, 16, 8, 12, 2
    x = rng.standard_normal((tokens, width)).astype(np.float32)
    gate_up = (rng.standard_normal((num_experts, width, 2 * size)) * 0.3).astype(np.float32)
    down = (rng.standard_normal((num_experts, size, width)) * 0.3).astype(np.float32)
    biases = tuple(rng.standard_normal((num_experts, n)).astype(np.float32) for n in (2 * size, width))
    weights = jax.nn.softmax(rng.standard_normal((tokens, k)).astype(np.float32))
    live = np.arange(tokens) < 27
    first_device = num_experts // tp
    random = np.stack([rng.choice(num_experts, k, replace=False) for _ in range(tokens)])
    routings = {
        "all on the first device": np.stack(
            [rng.choice(first_device, k, replace=False) for _ in range(tokens)]
        ),
        "all on the last two experts": np.tile([num_experts - 1, num_experts - 2], (tokens, 1)),
        "random": random,
        "random, biased experts": random,
    }
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))

    def by_experts(a):
        return jax.device_put(a, NamedSharding(mesh, P("tp")))

    forms = {"replicated": None, "all_to_all": 0}
    differences: dict[str, dict[str, float]] = {}
    for name, experts in routings.items():
        experts = experts.astype(np.int32)
        biased = biases if "biased" in name else None
        one = StackedProducts().mixture(x, weights, experts, gate_up, down, 0, live, "silu", biased)
        split = [by_experts(a) for a in (gate_up, down)]
        split_biases = None if biased is None else tuple(by_experts(b) for b in biased)
        for form, threshold in forms.items():
            products = ExpertParallelProducts(StackedProducts(), mesh, threshold)
            assert products.form(tokens) == form
            mixture = jax.jit(
                lambda x, w, e, g, d, live, b, p=products: p.mixture(
                    x, w, e, g, d, np.int32(0), live, "silu", b
                )
            )
            got = mixture(x, weights, experts, *split, live, split_biases)
            differences.setdefault(name, {})[form] = float(np.abs(np.asarray(got) - np.asarray(one)).max())
    return differences


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
    # n-gram speculation, its text held to ten tokens so that it repeats and proposals are accepted (two
    # sequences: max_num_seqs 4 leaves rows for proposals)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    speculating = LLM(model, num_blocks=40, enforce_eager=True, speculative_config=spec, **engine_args)
    repeats = SamplingParams(max_tokens=24, temperature=0.0, allowed_token_ids=list(range(200, 210)))
    results["speculative"] = [
        [o.outputs[0].token_ids for o in engine.generate(prompts[:2], repeats, use_tqdm=False)]
        for engine in (speculating, llm)
    ]
    results["accepted"] = speculating.engine.spec_decode_stats().num_accepted_tokens
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for mode in modes:  # 4 x 6 blocks wanted, 14 held: preemption
        small = LLM(
            model, num_blocks=14, preemption_mode=mode, swap_space=0.01, enforce_eager=True, **engine_args
        )
        outputs = small.generate(prompts, long, use_tqdm=False)
        results[f"preemption {mode}"] = [o.outputs[0].token_ids for o in outputs]
        results[f"preemptions {mode}"] = small.metrics()["num_preemptions"]
    return results


def lora_run(model: str, tp: int, adapters: list[str]) -> dict:
    """Greedy tokens and logprobs of every prompt under the base model and each adapter, in one batch, and how
    each device holds the adapter stacks of a matrix split by columns (qkv's B) and one split by rows (o's A)."""
    llm = LLM(
        model,
        tensor_parallel_size=tp,
        enable_lora=True,
        max_loras=len(adapters),
        max_lora_rank=16,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        num_blocks=60,
        enforce_eager=True,
    )
    from jpaged import LoRARequest

    loras = [None, *(LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters))]
    per_prompt = [lora for lora in loras for _ in PROMPTS]
    outputs = llm.generate(PROMPTS * len(loras), GREEDY, use_tqdm=False, lora_request=per_prompt)
    stacks = llm.engine.runner.lora.stacks
    return {
        "tokens": [o.outputs[0].token_ids for o in outputs],
        "logprobs": [
            [{str(k): v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs] for o in outputs
        ],
        "qkv_b_bytes": held_bytes(stacks["qkv"]["b"]),
        "o_a_bytes": held_bytes(stacks["o"]["a"]),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine-features", action="store_true")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--all-to-all", action="store_true")
    parser.add_argument("--warm", action="store_true")
    parser.add_argument("--mixture-forms", action="store_true")
    parser.add_argument("--lora", default=None, help="comma-separated PEFT adapter directories")
    parser.add_argument("model")
    parser.add_argument("sizes", nargs="*")
    args = parser.parse_args()
    if args.mixture_forms:
        print(json.dumps({tp: mixture_forms(int(tp)) for tp in [args.model, *args.sizes]}))
    elif args.lora:
        print(json.dumps({tp: lora_run(args.model, int(tp), args.lora.split(",")) for tp in args.sizes}))
    elif args.engine_features:
        print(json.dumps({tp: engine_features(args.model, int(tp)) for tp in args.sizes}))
    else:
        if args.all_to_all:
            expert_parallel.ALL_TO_ALL_FROM_TOKENS = 0
        model = None if args.model == "default" else args.model
        options = dict(expert_parallel=args.enable_expert_parallel, warm=args.warm)
        print(json.dumps({tp: run(model, int(tp), args.quantization, **options) for tp in args.sizes}))
