"""The model forward pass over the paged cache matches transformers for every supported family."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pre_nnx_llama
import pytest
from conftest import PRE_NNX_FAMILIES, TINY_FAMILIES, hf_logits
from jax.sharding import PartitionSpec as P

from jpaged.models.config import ModelConfig
from jpaged.models.families import FAMILIES, family_table
from jpaged.models.llama import (
    StepBatch,
    abstract_params,
    forward,
    init_kv_cache,
    params_dtype,
    partition_specs,
)
from jpaged.models.loader import load_model
from jpaged.models.products import StackedProducts
from jpaged.pallas.reference import paged_attention_stacked
from jpaged.runner.weight_layout import choose_products

BLOCK = 16


class PagedRun:
    """Drives the forward pass by hand: sequences get consecutive blocks, steps feed chosen token ranges."""

    def __init__(self, loaded, num_seqs: int, max_len: int = 128, layout: str = "stacked", products=None):
        products = products or choose_products(
            loaded.params, layout, activation=loaded.config.hidden_activation
        )
        params = products.layout(loaded.params)
        self.config, self.params = loaded.config, jax.device_put(params)
        self.width = max_len // BLOCK
        dtype = params_dtype(params)
        self.cache = init_kv_cache(self.config, 1 + num_seqs * self.width, BLOCK, dtype)
        forward_fn = functools.partial(
            forward, config=self.config, attention=paged_attention_stacked, products=products
        )
        self.fn = jax.jit(forward_fn)

    def step(self, seqs: list[list[int]], starts: list[int], ends: list[int]) -> list[np.ndarray]:
        """Compute tokens [start, end) of each sequence; returns each sequence's logits for those tokens."""
        tokens, positions, slots, query_start, rope_lengths = [], [], [], [0], []
        tables = np.zeros((len(seqs), self.width), np.int32)
        for i, (ids, start, end) in enumerate(zip(seqs, starts, ends, strict=True)):
            tables[i] = 1 + i * self.width + np.arange(self.width)
            pos = np.arange(start, end)
            tokens += ids[start:end]
            positions += list(pos)
            # The reference runs each whole sequence in one forward: every token's rope length is its length.
            rope_lengths += [max(len(ids), p + 1) for p in pos]
            slots += list(tables[i, pos // BLOCK] * BLOCK + pos % BLOCK)
            query_start.append(query_start[-1] + end - start)
        total = query_start[-1]
        batch = StepBatch(
            *(jnp.asarray(x, jnp.int32) for x in (tokens, positions, slots, tables, query_start, ends)),
            jnp.asarray([len(seqs)], jnp.int32),
            jnp.arange(total, dtype=jnp.int32),
            jnp.asarray([total], jnp.int32),
            jnp.asarray(rope_lengths, jnp.int32),
        )
        logits, self.cache = self.fn(self.params, self.cache, batch)
        logits = np.asarray(logits)
        return [logits[query_start[i] : query_start[i + 1]] for i in range(len(seqs))]


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


# "stacked": accelerators' layout; "panels": the CPU matmul kernel's (runner.weight_layout)
@pytest.mark.parametrize("layout", ["stacked", "panels"])
@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_logits_match_transformers_for_ragged_prefill_and_paged_decode(family, layout, tiny_model_dir):
    model_dir = tiny_model_dir(family)
    loaded = load_model(str(model_dir), progress=False)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, 49152, n))) for n in (5, 16, 23, 41)]
    expected = [hf_logits(model_dir, p) for p in prompts]

    run = PagedRun(loaded, len(prompts), layout=layout)
    # Step 1: ragged prefill of all but the last 3 tokens of every prompt, in one batch.
    lengths = [len(p) for p in prompts]
    got = run.step(prompts, [0] * 4, [n - 3 for n in lengths])
    # Steps 2-4: single-token decodes that read everything earlier from the paged cache.
    for k in (3, 2, 1):
        for i, logits in enumerate(run.step(prompts, [n - k for n in lengths], [n - k + 1 for n in lengths])):
            got[i] = np.concatenate([got[i], logits])
    for prompt_logits, reference in zip(got, expected, strict=True):
        assert relative_error(prompt_logits, reference) < 1e-4


def pre_nnx_run(loaded, num_seqs: int) -> PagedRun:
    """A PagedRun of the functional model the NNX modules replaced."""
    run = PagedRun(loaded, num_seqs)
    run.params = jax.device_put(pre_nnx_llama.flat_params(loaded.params))
    forward_fn = functools.partial(
        pre_nnx_llama.forward, config=loaded.config, attention=paged_attention_stacked
    )
    run.fn = jax.jit(forward_fn)
    return run


def assert_same_logits_as_before_the_port(loaded, layout: str, prompt_lengths: tuple[int, ...]) -> None:
    rng = np.random.default_rng(2)
    prompts = [list(map(int, rng.integers(0, loaded.config.vocab_size, n))) for n in prompt_lengths]
    lengths = [len(p) for p in prompts]
    runs = (PagedRun(loaded, len(prompts), layout=layout), pre_nnx_run(loaded, len(prompts)))
    schedule = [([0] * len(prompts), [n - 2 for n in lengths])]  # a ragged prefill, then two decodes each
    schedule += [([n - k for n in lengths], [n - k + 1 for n in lengths]) for k in (2, 1)]
    for starts, ends in schedule:
        got, expected = (run.step(prompts, starts, ends) for run in runs)
        for actual, reference in zip(got, expected, strict=True):
            assert relative_error(actual, reference) < 1e-5
            np.testing.assert_array_equal(actual.argmax(-1), reference.argmax(-1))  # the greedy tokens


@pytest.mark.parametrize("layout", ["stacked", "panels"])
@pytest.mark.parametrize("family", PRE_NNX_FAMILIES)  # what the functional model served
def test_nnx_modules_give_the_logits_of_the_functional_model_they_replaced(family, layout, tiny_model_dir):
    loaded = load_model(str(tiny_model_dir(family)), progress=False)
    assert_same_logits_as_before_the_port(loaded, layout, (5, 16, 23, 41))


@pytest.mark.parametrize("family", ["llama", "qwen2_bias", "qwen2_moe"])
def test_fused_columns_grouped_per_shard_give_the_same_logits(family, tiny_model_dir):
    """Tensor parallelism's layout of QKV (and its bias) and gate/up (a mixture's experts' and shared expert's):
    run g holds shard g's heads and columns."""
    loaded = load_model(str(tiny_model_dir(family)), progress=False)
    rng = np.random.default_rng(3)
    prompts = [list(map(int, rng.integers(0, loaded.config.vocab_size, n))) for n in (7, 12)]
    grouped = PagedRun(loaded, 2, products=StackedProducts(loaded.config, fused_groups=2))
    plain = PagedRun(loaded, 2)
    steps = (run.step(prompts, [0, 0], [7, 12]) for run in (grouped, plain))
    for got, expected in zip(*steps, strict=True):
        assert relative_error(got, expected) < 1e-6


def test_nnx_modules_give_the_embedded_models_logits_of_before_the_port():
    assert_same_logits_as_before_the_port(load_model(None, progress=False), "stacked", (9, 20))


def test_weights_name_their_logical_axes_for_tensor_parallelism(tiny_model_dir):
    specs = {
        family: partition_specs(load_model(str(tiny_model_dir(family)), progress=False).config)
        for family in ("llama", "qwen2_bias", "qwen3_qk_norm")
    }
    llama = specs["llama"]
    assert llama["embed"]["weight"] == P("vocab", "embed")
    assert llama["lm_head"] == P("embed", "vocab")
    assert llama["final_norm"]["weight"] == P("embed")
    layers = llama["layers"]
    assert layers["attn_norm"]["weight"] == layers["mlp_norm"]["weight"] == P("layers", "embed")
    assert layers["attn"]["qkv"] == P("layers", "embed", "qkv")
    assert layers["attn"]["o"] == P("layers", "heads", "embed")
    assert layers["mlp"]["gate_up"] == P("layers", "embed", "mlp")
    assert layers["mlp"]["down"] == P("layers", "mlp", "embed")
    assert "lm_head" not in specs["qwen2_bias"]  # tied to the embedding
    assert specs["qwen2_bias"]["layers"]["attn"]["qkv_bias"] == P("layers", "qkv")
    assert specs["qwen3_qk_norm"]["layers"]["attn"]["q_norm"]["weight"] == P("layers", "head_dim")


def test_the_loaders_fill_exactly_the_state_of_the_nnx_module(tiny_model_dir):
    for family in sorted(TINY_FAMILIES):
        loaded = load_model(str(tiny_model_dir(family)), progress=False)
        expected = abstract_params(loaded.config, jnp.float32)
        shapes = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), expected)
        assert jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), loaded.params) == shapes


def test_bfloat16_panels_give_the_logits_of_the_stacked_layout(tiny_model_dir):
    """The matmul kernel's bfloat16 path (float32 sums, bfloat16 results) against XLA's bfloat16 dots."""
    loaded = load_model(str(tiny_model_dir("smollm2_tied")), dtype=jnp.bfloat16, progress=False)
    prompts = [list(map(int, np.random.default_rng(1).integers(0, 49152, n))) for n in (7, 30)]
    runs = {layout: PagedRun(loaded, len(prompts), layout=layout) for layout in ("stacked", "panels")}
    for starts, ends in (([0, 0], [5, 28]), ([5, 28], [7, 30])):  # a ragged prefill, then two tokens each
        stacked, panels = (runs[layout].step(prompts, starts, ends) for layout in ("stacked", "panels"))
        for expected, got in zip(stacked, panels, strict=True):
            assert relative_error(got, expected) < 2e-2


def test_panels_give_the_same_logits_with_and_without_the_gated_form(tiny_model_dir):
    """The matmul kernel's gated form (the MLP's activation on the gate|up sums) against the unfused product with
    XLA's activation, which panels take where gate and up are not multiples of 16 wide."""
    loaded = load_model(str(tiny_model_dir("llama")), progress=False)
    gated = choose_products(loaded.params, "panels", activation="silu")
    assert gated.gated_form
    prompts = [list(map(int, np.random.default_rng(4).integers(0, 49152, n))) for n in (9, 20)]
    runs = [
        PagedRun(loaded, len(prompts), products=p)
        for p in (gated, dataclasses.replace(gated, gated_form=False))
    ]
    for starts, ends in (([0, 0], [7, 18]), ([7, 18], [9, 20])):
        with_form, without = (run.step(prompts, starts, ends) for run in runs)
        for expected, got in zip(without, with_form, strict=True):
            assert relative_error(got, expected) < 1e-5
            np.testing.assert_array_equal(got.argmax(-1), expected.argmax(-1))


def test_unsupported_architecture_is_a_value_error_listing_the_registrys_families(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'") as raised:
        load_model(str(tmp_path), progress=False)
    assert str(raised.value).endswith(f"jpaged supports {', '.join(FAMILIES)}")
    assert {"llama", "mistral", "qwen2", "qwen3", "phi3"} <= set(FAMILIES)


def test_every_registered_family_has_a_tiny_model_here_and_a_row_in_the_family_table():
    import transformers

    configs = (getattr(transformers, name)(**kwargs).to_dict() for name, kwargs in TINY_FAMILIES.values())
    tested = {ModelConfig.from_hf_config(config).architecture for config in configs}
    assert tested == set(FAMILIES)
    rows = family_table().splitlines()[2:]
    assert [row.split(" | ")[0].strip("| ") for row in rows] == list(FAMILIES)
    assert family_table() in (Path(__file__).parent.parent / "README.md").read_text()  # README lists them all


def test_missing_model_path_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(str(tmp_path / "nope"), progress=False)


def test_unreadable_model_config_is_a_value_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read model config"):
        load_model(str(tmp_path), progress=False)


def test_hub_id_offline_fails_with_one_clear_sentence(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="could not fetch 'some-org/some-model' from the Hugging Face hub"):
        load_model("some-org/some-model", progress=False)
