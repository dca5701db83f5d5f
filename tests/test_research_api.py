"""JAX research code drives the engine with its own weights and arrays: weights swapped in place without a
compile, token-id arrays in and padded device arrays out, device memory given back between generate calls."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jpaged.entrypoints.llm import LLM
from jpaged.models.llama import model_graphdef
from jpaged.sampling_params import SamplingParams

ENGINE_ARGS = dict(
    max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, num_blocks=64, enforce_eager=True
)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(100 + i, 140 + i)) for i in range(3)]  # 40 tokens: two full blocks each to cache


def redrawn(params: dict, seed: int) -> dict:
    """New weights of the same shapes and dtypes, drawn like the old ones (what a training step leaves)."""
    rng = np.random.default_rng(seed)

    def draw(leaf):
        leaf = np.asarray(leaf)
        return (rng.standard_normal(leaf.shape) * leaf.std() + leaf.mean()).astype(leaf.dtype)

    return jax.tree_util.tree_map(draw, params)


def token_lists(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture
def llm(tiny_llama):
    return LLM.from_params(tiny_llama.params, tiny_llama.config, tiny_llama.tokenizer, **ENGINE_ARGS)


def test_an_engine_over_params_in_memory_generates_as_one_loaded_from_disk(llm, tiny_llama_dir):
    assert token_lists(llm) == token_lists(LLM(str(tiny_llama_dir), **ENGINE_ARGS))


def test_updated_weights_generate_as_a_fresh_engine_on_them_and_compile_nothing(llm, tiny_llama):
    before = token_lists(llm)
    compilations = llm.metrics()["num_compilations"]
    new = jax.device_put(redrawn(tiny_llama.params, seed=1))  # a trainer's weights: device arrays
    llm.update_weights(new)
    after = token_lists(llm)
    assert after != before  # the new weights are the ones running
    fresh = LLM.from_params(new, tiny_llama.config, tiny_llama.tokenizer, **ENGINE_ARGS)
    assert after == token_lists(fresh)
    assert llm.metrics()["num_compilations"] == compilations


def test_update_weights_drops_the_prefix_cache_computed_with_the_old_weights(llm, tiny_llama):
    token_lists(llm)
    hits = llm.metrics()["prefix_cache_hits"]
    token_lists(llm)
    assert llm.metrics()["prefix_cache_hits"] > hits  # the same prompts hit their cached blocks
    hits = llm.metrics()["prefix_cache_hits"]
    llm.update_weights(redrawn(tiny_llama.params, seed=2))
    token_lists(llm)
    assert llm.metrics()["prefix_cache_hits"] == hits


def test_an_engine_over_a_users_own_nnx_module_takes_its_updates_as_modules_or_states(llm, tiny_llama):
    module = nnx.merge(model_graphdef(tiny_llama.config), jax.device_put(tiny_llama.params))
    from_module = LLM.from_flax(module, tiny_llama.tokenizer, **ENGINE_ARGS)
    assert token_lists(from_module) == token_lists(llm)
    compilations = from_module.metrics()["num_compilations"]
    new = redrawn(tiny_llama.params, seed=3)
    nnx.update(module, new)  # what a trainer's optimizer step does to its module
    from_module.update_weights(module)
    llm.update_weights(nnx.state(module))
    assert (
        token_lists(from_module)
        == token_lists(llm)
        != token_lists(
            LLM.from_params(tiny_llama.params, tiny_llama.config, tiny_llama.tokenizer, **ENGINE_ARGS)
        )
    )
    assert from_module.metrics()["num_compilations"] == compilations


def test_a_module_that_is_not_a_jpaged_model_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="must be a jpaged.models.llama.CausalLM"):
        LLM.from_flax(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), tiny_llama.tokenizer, **ENGINE_ARGS)


def test_params_in_another_tree_are_refused_at_start_naming_the_leaf(tiny_llama):
    old_tree = {
        "embed": tiny_llama.params["embed"]["weight"],
        **{k: v for k, v in tiny_llama.params.items() if k != "embed"},
    }
    with pytest.raises(ValueError, match=r"params\['embed'\]\['weight'\] is missing from the params given"):
        LLM.from_params(old_tree, tiny_llama.config, tiny_llama.tokenizer, **ENGINE_ARGS)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda p: p["layers"]["attn"].update(qkv=p["layers"]["attn"]["qkv"][:, :, :-1]),
            r"params\['layers'\]\['attn'\]\['qkv'\]",
        ),
        (
            lambda p: p["embed"].update(weight=p["embed"]["weight"].astype(np.float16)),
            r"params\['embed'\]\['weight'\] is float16",
        ),
        (lambda p: p["layers"]["mlp"].pop("down"), r"params\['layers'\]\['mlp'\]\['down'\] is missing"),
        (
            lambda p: p.update(extra=np.zeros(3, np.float32)),
            r"params\['extra'\] in the new weights is not one of",
        ),
    ],
    ids=["shape", "dtype", "missing", "extra"],
)
def test_weights_that_do_not_match_are_refused_naming_the_leaf(llm, tiny_llama, change, message):
    params = jax.tree_util.tree_map(np.asarray, tiny_llama.params)  # new dicts all the way down
    change(params)
    with pytest.raises(ValueError, match=message):
        llm.update_weights(params)


def test_update_weights_waits_for_an_idle_engine(llm, tiny_llama):
    llm.engine.add_request("running", PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="needs an idle engine"):
        llm.update_weights(tiny_llama.params)
    llm.engine.abort_request("running")
    assert llm.metrics()["num_free_blocks"] == llm.metrics()["num_total_blocks"]


def test_generate_arrays_equals_generate_with_the_samplers_logprobs(llm):
    lengths = np.array([40, 25, 33])
    ids = np.zeros((3, 40), np.int32)
    for row, (prompt, length) in enumerate(zip(PROMPTS, lengths, strict=True)):
        ids[row, :length] = prompt[:length]
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=3)
    out = llm.generate_arrays(jax.numpy.asarray(ids), lengths, params, return_logprobs=True, pad_token_id=-1)
    assert isinstance(out.tokens, jax.Array) and out.tokens.shape == (3, 10) and out.logprobs.shape == (3, 10)
    expected = llm.generate(
        [p[:n] for p, n in zip(PROMPTS, lengths, strict=True)],
        SamplingParams(max_tokens=10, temperature=0.8, seed=3, logprobs=0),
        use_tqdm=False,
    )
    tokens, counts, logprobs = (np.asarray(x) for x in (out.tokens, out.lengths, out.logprobs))
    for row, output in enumerate(expected):
        completion = output.outputs[0]
        count = len(completion.token_ids)
        assert counts[row] == count and tokens[row, :count].tolist() == completion.token_ids
        assert (tokens[row, count:] == -1).all() and (logprobs[row, count:] == 0).all()
        sampled = [
            entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs, strict=True)
        ]
        np.testing.assert_allclose(logprobs[row, :count], sampled, rtol=1e-6)


def test_generate_takes_token_arrays_too(llm):
    assert token_lists(llm, np.asarray(PROMPTS)) == token_lists(llm)
    assert token_lists(llm, [np.asarray(p) for p in PROMPTS]) == token_lists(llm)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"lengths": [40, 0, 3]}, "lengths"),
        ({"lengths": [40, 3]}, "lengths"),
        ({"token_ids": np.zeros(4)}, "token_ids"),
    ],
)
def test_bad_token_arrays_are_refused_naming_the_field(llm, kwargs, field):
    args = {"token_ids": np.asarray(PROMPTS), **kwargs}
    with pytest.raises(ValueError, match=field):
        llm.generate_arrays(args.pop("token_ids"), args.get("lengths"), GREEDY)


def test_sleep_frees_the_pool_and_wake_up_serves_again_without_compiling(llm):
    before = token_lists(llm)
    compilations = llm.metrics()["num_compilations"]
    pool = llm.engine.runner.kv_cache
    llm.sleep()
    assert all(pages.is_deleted() for pages in pool)
    with pytest.raises(ValueError, match="asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert token_lists(llm) == before
    assert llm.metrics()["num_compilations"] == compilations


def test_after_a_deep_sleep_the_weights_come_back_through_update_weights(llm, tiny_llama):
    before = token_lists(llm)
    llm.sleep(level=2)
    with pytest.raises(ValueError, match="update_weights"):
        llm.wake_up()
    llm.update_weights(tiny_llama.params)
    llm.wake_up()
    assert token_lists(llm) == before


@pytest.mark.parametrize("trained", [[], ["--lora", "4"]], ids=["weights", "lora adapter"])
def test_the_rl_rollout_demo_trains_while_jpaged_generates_and_compiles_nothing_after_its_first_step(trained):
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "scripts/rl_rollout_demo.py", "--steps", "3", *trained]
    result = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| 2 |" in result.stdout  # every step ran
    assert "compilations after the first step: 0" in result.stdout
