"""LoRA adapters through the engine: each request's greedy path is transformers' with its adapter merged by PEFT,
whatever else shares the batch; adapters load, unload, swap slots and change weights without a compile, a lost
request or a prefix-cache hit from another adapter."""

from __future__ import annotations

import numpy as np
import pytest
from greedy import assert_follows_transformers, tokens_of
from peft_adapters import ALL_TARGETS, make_adapter
from safetensors.numpy import load_file

from jpaged import LLM, LoRARequest, SamplingParams

PROMPTS = [list(range(100, 120)), [7, 7, 7, 9], list(range(300, 340))]
ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64, num_blocks=96)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    """Four adapters of different ranks and targets (one rsLoRA), and a fifth of the first one's shapes."""
    root = tmp_path_factory.mktemp("adapters")
    specs = {
        "qv4": dict(rank=4, targets=("q_proj", "v_proj"), seed=1),
        "all8": dict(rank=8, targets=ALL_TARGETS, seed=2),
        "od16": dict(rank=16, targets=("o_proj", "down_proj"), seed=3, use_rslora=True),
        "kgu2": dict(rank=2, targets=("k_proj", "gate_proj", "up_proj"), seed=4),
        "qv4b": dict(rank=4, targets=("q_proj", "v_proj"), seed=5),
    }
    made = {name: make_adapter(tiny_llama_dir, root, name, **spec) for name, spec in specs.items()}
    return {name: (LoRARequest(name, i + 1, str(a.path)), a) for i, (name, a) in enumerate(made.items())}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    """Four slots, warmed up: every step shape compiled before the first request."""
    return LLM(str(tiny_llama_dir), enable_lora=True, max_loras=4, max_lora_rank=16, **ENGINE)


def _generate(llm: LLM, loras: list, max_tokens: int = 8):
    """Every prompt under every adapter in `loras` (None: the base model), all in one batch."""
    prompts = [p for _ in loras for p in PROMPTS]
    per_prompt = [lora for lora in loras for _ in PROMPTS]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    return llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=per_prompt
    )


def test_four_adapters_mixed_with_the_base_model_follow_transformers_with_each_adapter_merged(
    llm, adapters, tiny_llama_dir
):
    names = ["qv4", "all8", "od16", "kgu2"]
    loras = [None, *(adapters[name][0] for name in names)]
    outputs = _generate(llm, loras)
    by_adapter = [outputs[i : i + len(PROMPTS)] for i in range(0, len(outputs), len(PROMPTS))]
    assert_follows_transformers(tiny_llama_dir, by_adapter[0], "base", tolerance=1e-4)
    for name, group in zip(names, by_adapter[1:], strict=True):
        assert_follows_transformers(adapters[name][1].merged, group, name, tolerance=1e-4)
        assert tokens_of(group) != tokens_of(by_adapter[0]), f"{name} changed nothing"


@pytest.mark.parametrize(
    ("family", "targets"),
    [
        (
            "phi3",
            ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
        ),  # fused modules: one lora_A for their parts
        (
            "gemma2",
            ("q_proj", "v_proj", "gate_proj", "down_proj"),
        ),  # GELU: the unfused MLP, post-norms, soft caps
        ("qwen3_moe", ("q_proj", "k_proj", "v_proj", "o_proj")),  # attention only: experts take no adapter
    ],
)
def test_other_families_adapters_follow_transformers_with_the_adapter_merged(
    family, targets, tiny_model_dir, tmp_path
):
    base = tiny_model_dir(family)
    adapter = make_adapter(base, tmp_path, family, rank=8, targets=targets, seed=7)
    llm = LLM(str(base), enable_lora=True, max_lora_rank=8, enforce_eager=True, **ENGINE)
    lora = LoRARequest(family, 1, str(adapter.path))
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS[:2]] * 2,
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2),
        use_tqdm=False,
        lora_request=[lora, lora, None, None],
    )
    assert_follows_transformers(adapter.merged, outputs[:2], family, tolerance=1e-4)
    assert_follows_transformers(base, outputs[2:], f"{family} base", tolerance=1e-4)
    assert tokens_of(outputs[:2]) != tokens_of(outputs[2:])


def test_adapters_load_unload_and_swap_slots_under_load_without_compiling_or_losing_a_request(llm, adapters):
    compiled = llm.metrics()["num_compilations"]
    engine = llm.engine
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("base", PROMPTS[0], params)
    engine.add_request("qv4", PROMPTS[0], params, lora_request=adapters["qv4"][0])
    engine.step()
    engine.add_lora(adapters["kgu2"][0])
    engine.add_request("kgu2", PROMPTS[1], params, lora_request=adapters["kgu2"][0])
    engine.step()
    assert engine.remove_lora(adapters["qv4"][0].lora_int_id)  # in use: its request finishes with it
    assert adapters["qv4"][0] not in engine.list_loras()
    engine.add_request("all8", PROMPTS[2], params, lora_request=adapters["all8"][0])
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(finished) == ["all8", "base", "kgu2", "qv4"]
    assert all(len(o.outputs[0].token_ids) == 12 for o in finished.values())
    reference = _generate(llm, [adapters["qv4"][0]], max_tokens=12)[0]
    assert finished["qv4"].outputs[0].token_ids == reference.outputs[0].token_ids
    assert llm.metrics()["num_compilations"] == compiled
    assert llm.metrics()["num_free_blocks"] == llm.metrics()["num_total_blocks"]


def test_more_adapters_than_slots_are_served_by_swapping_idle_ones_out(llm, adapters, tiny_llama_dir):
    names = ["qv4", "all8", "od16", "kgu2"]
    four_slots = tokens_of(_generate(llm, [adapters[name][0] for name in names]))
    small = LLM(
        str(tiny_llama_dir), enable_lora=True, max_loras=2, max_lora_rank=16, enforce_eager=True, **ENGINE
    )
    outputs = _generate(small, [adapters[name][0] for name in names])
    assert tokens_of(outputs) == four_slots
    stats = small.engine.lora_stats()
    assert stats.slot_loads >= 4 and stats.evictions >= 2
    assert stats.slots_in_use == 0 and stats.slots_filled == 2


def test_a_request_waits_for_a_slot_while_those_behind_it_go_on(adapters, tiny_llama_dir):
    one = LLM(
        str(tiny_llama_dir), enable_lora=True, max_loras=1, max_lora_rank=16, enforce_eager=True, **ENGINE
    )
    engine = one.engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("first", PROMPTS[0], params, lora_request=adapters["qv4"][0])
    engine.add_request("second", PROMPTS[0], params, lora_request=adapters["all8"][0])
    engine.add_request("base", PROMPTS[0], params)
    engine.step()
    running = {seq.request.request_id for seq in engine.scheduler.running}
    assert running == {"first", "base"}  # "second" waits: the one slot is in use
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(finished) == ["base", "first", "second"]
    assert engine.lora_stats().slot_loads == 2


def test_the_prefix_cache_never_serves_one_adapters_blocks_to_another_or_to_the_base(llm, adapters):
    prompt = {"prompt_token_ids": list(range(1000, 1040))}  # two full blocks and a half
    params = SamplingParams(max_tokens=2, temperature=0.0)

    def cached(lora):
        return llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    qv4, all8 = adapters["qv4"][0], adapters["all8"][0]
    assert cached(None) == 0
    assert cached(qv4) == 0  # the base's blocks are not the adapter's
    assert cached(qv4) == 32
    assert cached(all8) == 0
    assert cached(None) == 32


def test_update_lora_swaps_an_adapters_weights_in_place_without_compiling(llm, adapters, tiny_llama_dir):
    request, _ = adapters["qv4b"]
    other, other_files = adapters["qv4"]
    before = tokens_of(_generate(llm, [request]))
    compiled = llm.metrics()["num_compilations"]
    llm.update_lora("qv4b", load_file(other_files.path / "adapter_model.safetensors"))
    after = _generate(llm, [request])
    assert tokens_of(after) == tokens_of(_generate(llm, [other])) != before
    assert_follows_transformers(other_files.merged, after, "updated", tolerance=1e-4)
    assert llm.metrics()["num_compilations"] == compiled


def test_bad_adapters_and_misuse_are_value_errors_naming_what_is_wrong(
    llm, adapters, tiny_llama_dir, tmp_path
):
    with pytest.raises(ValueError, match="max_lora_rank"):
        big = make_adapter(tiny_llama_dir, tmp_path, "r32", rank=32, targets=("q_proj",))
        llm.engine.add_lora(LoRARequest("r32", 90, str(big.path)))
    with pytest.raises(ValueError, match="adapter_config.json"):
        llm.engine.add_lora(LoRARequest("nowhere", 91, str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="is adapter 'qv4' already"):
        llm.engine.add_lora(
            LoRARequest("renamed", adapters["qv4"][0].lora_int_id, adapters["qv4"][0].lora_path)
        )
    with pytest.raises(ValueError, match="no LoRA adapter named"):
        llm.update_lora("missing", {})
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("zero", 0, "x")
    plain = LLM(str(tiny_llama_dir), enforce_eager=True, **ENGINE)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate([PROMPTS[0]], lora_request=adapters["qv4"][0], use_tqdm=False)
    assert plain.metrics()["num_free_blocks"] == plain.metrics()["num_total_blocks"]


def test_the_step_reads_adapters_in_any_delta_form_alike():
    """models/lora.py's three XLA forms of the per-token delta, and the C++ kernel's (runner/lora_panels.py: a fused
    matrix of three parts, W = 24 padded to 32), written slot by slot, agree with a float64 numpy oracle; so does a
    step with no adapter (the kernel's skipped branch)."""
    import jax.numpy as jnp

    from jpaged.models.lora import LORA_METHODS, XlaLoRA
    from jpaged.runner.lora_panels import PanelLoRA

    rng = np.random.default_rng(0)
    layers, num_slots, fan_in, rank, sizes = 2, 3, 24, 8, (16, 8, 8)
    width, fan_out = 3 * rank, sum(sizes)
    a = rng.normal(size=(layers, num_slots, fan_in, width))
    b = np.zeros(
        (layers, num_slots, width, fan_out)
    )  # block-diagonal by part, as models/lora_weights lays it
    for p, start in enumerate(np.cumsum((0, *sizes))[:-1]):
        block = rng.normal(size=(layers, num_slots, rank, sizes[p]))
        b[..., p * rank : (p + 1) * rank, start : start + sizes[p]] = block
    x, slots = rng.normal(size=(11, fan_in)), np.array([0, 1, 2, 3, 3, 0, 2, 1, 1, 3, 0], np.int32)
    layouts = [XlaLoRA(method) for method in LORA_METHODS] + [
        PanelLoRA(num_slots, (("qkv", width, fan_out),))
    ]
    for layout in layouts:
        shapes = layout.shapes(fan_in, width, fan_out, layers, num_slots)
        stacks = {
            "qkv": {part: jnp.zeros(shape, jnp.float32) for part, shape in zip("ab", shapes, strict=True)}
        }
        for row in range(num_slots):
            adapter = {
                "qkv": {"a": jnp.asarray(a[:, row], jnp.float32), "b": jnp.asarray(b[:, row], jnp.float32)}
            }
            stacks = layout.write(stacks, jnp.int32(row), adapter)
        for layer in range(layers):
            expected = np.stack(
                [
                    x[t] @ a[layer, s - 1] @ b[layer, s - 1] if s else np.zeros(fan_out)
                    for t, s in enumerate(slots)
                ]
            )
            stack = stacks["qkv"] if layout.whole_stacks else {k: v[layer] for k, v in stacks["qkv"].items()}
            got = layout.delta(
                "qkv", jnp.asarray(x, jnp.float32), stack, jnp.asarray(slots), jnp.int32(layer), 11
            )
            np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-4, err_msg=repr(layout))
        none = layout.delta(
            "qkv", jnp.asarray(x, jnp.float32), stack, jnp.zeros(11, jnp.int32), jnp.int32(0), 11
        )
        assert not np.asarray(none).any()
