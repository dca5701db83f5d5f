"""PEFT LoRA adapters read into the engine's fixed shapes (models/lora_weights.py): tiny random models built by
transformers, adapters trained-looking (init_lora_weights=False: B random) and saved by peft, and PEFT's own
get_delta_weight as the oracle: x @ A[l] @ B[l] must be each targeted module's delta in the fused column order."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from conftest import TINY_FAMILIES
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

from jpaged.models.config import ModelConfig
from jpaged.models.lora_weights import adapter_from_tensors, lora_shapes, read_adapter

ALL_LLAMA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Each matrix's transformers modules in the state's column order (layer submodule, module names).
LLAMA_MODULES = {
    "qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o": ("self_attn", ("o_proj",)),
    "gate_up": ("mlp", ("gate_proj", "up_proj")),
    "down": ("mlp", ("down_proj",)),
}
PHI3_MODULES = {
    **LLAMA_MODULES,
    "qkv": ("self_attn", ("qkv_proj",)),
    "gate_up": ("mlp", ("gate_up_proj",)),
}
MAX_RANK = 16


def tiny_model(family: str):
    """A tiny random transformers model of TINY_FAMILIES' `family`, and jpaged's config of it."""
    class_name, kwargs = TINY_FAMILIES[family]
    hf_config = getattr(transformers, class_name)(**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    return model, ModelConfig.from_hf_config(hf_config.to_dict())


def saved_adapter(tmp_path, family: str = "llama", **lora):
    """A PEFT model with random A and B over a tiny `family` model, saved to tmp_path; and jpaged's config."""
    model, config = tiny_model(family)
    torch.manual_seed(1)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    peft_model.save_pretrained(tmp_path)
    return peft_model, config


def peft_deltas(peft_model, config: ModelConfig, modules: dict) -> dict[str, np.ndarray]:
    """Each matrix's delta [L, in, out] as PEFT computes it (scale included), modules' deltas side by side in the
    state's column order; zero where a module has no adapter."""
    base = peft_model.base_model.model
    deltas = {}
    for matrix, (parent, names) in modules.items():
        layers = []
        for i in range(config.num_layers):
            parts = []
            for name in names:
                module = base.get_submodule(f"model.layers.{i}.{parent}.{name}")
                if hasattr(module, "lora_A") and "default" in module.lora_A:
                    delta = module.get_delta_weight("default").detach().numpy()
                else:
                    delta = np.zeros(tuple(module.weight.shape), np.float32)
                parts.append(delta.T)
            layers.append(np.concatenate(parts, axis=1))
        deltas[matrix] = np.stack(layers)
    return deltas


def assert_deltas_match(adapter, expected: dict[str, np.ndarray]) -> None:
    assert set(adapter.weights) == set(expected)
    for matrix, delta in expected.items():
        got = adapter.weights[matrix]["a"] @ adapter.weights[matrix]["b"]
        np.testing.assert_allclose(got, delta, rtol=1e-6, atol=1e-6, err_msg=matrix)


def test_shapes_are_parts_times_max_rank_wide_and_a_mixture_of_experts_has_only_attention():
    _, config = tiny_model("llama")  # D 64, F 128, 4 query heads and 2 KV heads of 16
    assert lora_shapes(config, MAX_RANK) == {
        "qkv": (64, 48, 128),
        "o": (64, 16, 64),
        "gate_up": (64, 32, 256),
        "down": (128, 16, 64),
    }
    class_name, kwargs = TINY_FAMILIES["qwen3_moe"]
    moe = ModelConfig.from_hf_config(getattr(transformers, class_name)(**kwargs).to_dict())
    assert set(lora_shapes(moe, MAX_RANK)) == {"qkv", "o"}


def test_every_llama_module_gives_peft_deltas_in_fused_column_order(tmp_path):
    peft_model, config = saved_adapter(tmp_path, r=8, lora_alpha=16, target_modules=ALL_LLAMA)
    adapter = read_adapter(tmp_path, config, MAX_RANK)
    assert adapter.rank == 8 and adapter.config["r"] == 8
    assert {m: (w["a"].shape[1:], w["b"].shape[1:]) for m, w in adapter.weights.items()} == {
        m: ((i, w), (w, o)) for m, (i, w, o) in lora_shapes(config, MAX_RANK).items()
    }
    assert all(w[k].dtype == np.float32 for w in adapter.weights.values() for k in "ab")
    assert_deltas_match(adapter, peft_deltas(peft_model, config, LLAMA_MODULES))


def test_each_part_owns_max_rank_columns_of_a_and_its_own_block_of_b(tmp_path):
    peft_model, config = saved_adapter(tmp_path, r=8, lora_alpha=16, target_modules=ALL_LLAMA)
    weights = read_adapter(tmp_path, config, MAX_RANK).weights["qkv"]
    q, k, v = 64, 32, 32
    offsets = (0, q, q + k, q + k + v)
    for part, name in enumerate(("q_proj", "k_proj", "v_proj")):
        module = peft_model.base_model.model.model.layers[1].self_attn.get_submodule(name)
        lora_a = module.lora_A["default"].weight.detach().numpy()
        lora_b = module.lora_B["default"].weight.detach().numpy()
        block = slice(part * MAX_RANK, part * MAX_RANK + 8)
        columns = slice(offsets[part], offsets[part + 1])
        np.testing.assert_array_equal(weights["a"][1, :, block], lora_a.T)
        np.testing.assert_allclose(weights["b"][1, block, columns], 2.0 * lora_b.T, rtol=1e-7)
        b_rows = weights["b"][1, block].copy()
        b_rows[:, columns] = 0
        assert not b_rows.any()  # block-diagonal by part
        padding = slice(part * MAX_RANK + 8, (part + 1) * MAX_RANK)
        assert not weights["a"][1, :, padding].any() and not weights["b"][1, padding].any()


def test_rslora_scales_by_alpha_over_the_square_root_of_the_rank(tmp_path):
    peft_model, config = saved_adapter(
        tmp_path, r=16, lora_alpha=8, use_rslora=True, target_modules=ALL_LLAMA
    )
    adapter = read_adapter(tmp_path, config, MAX_RANK)
    assert_deltas_match(adapter, peft_deltas(peft_model, config, LLAMA_MODULES))


def test_rank_and_alpha_patterns_scale_the_modules_they_match(tmp_path):
    peft_model, config = saved_adapter(
        tmp_path,
        r=8,
        lora_alpha=16,
        rank_pattern={"v_proj": 4, "layers.1.mlp.down_proj": 2},
        alpha_pattern={"o_proj": 3, "gate_proj": 64},
        target_modules=ALL_LLAMA,
    )
    adapter = read_adapter(tmp_path, config, MAX_RANK)
    assert adapter.rank == 8
    assert not adapter.weights["qkv"]["a"][0, :, 2 * MAX_RANK + 4 :].any()  # v's rank 4
    assert_deltas_match(adapter, peft_deltas(peft_model, config, LLAMA_MODULES))


def test_what_the_adapter_does_not_target_stays_zero(tmp_path):
    peft_model, config = saved_adapter(
        tmp_path, r=4, lora_alpha=8, target_modules=["k_proj", "down_proj"], layers_to_transform=[1]
    )
    adapter = read_adapter(tmp_path, config, MAX_RANK)
    assert adapter.rank == 4
    for name in ("o", "gate_up"):
        assert not adapter.weights[name]["a"].any() and not adapter.weights[name]["b"].any()
    for name in ("qkv", "down"):
        assert not adapter.weights[name]["a"][0].any() and not adapter.weights[name]["b"][0].any()
    qkv = adapter.weights["qkv"]
    assert qkv["a"][1, :, MAX_RANK : MAX_RANK + 4].any()
    assert not np.delete(qkv["a"][1], np.s_[MAX_RANK : MAX_RANK + 4], axis=1).any()
    assert_deltas_match(adapter, peft_deltas(peft_model, config, LLAMA_MODULES))


def test_phi3_fused_qkv_proj_and_gate_up_proj_give_peft_deltas(tmp_path):
    peft_model, config = saved_adapter(
        tmp_path,
        "phi3",
        r=8,
        lora_alpha=16,
        target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    )
    adapter = read_adapter(tmp_path, config, MAX_RANK)
    qkv_a = adapter.weights["qkv"]["a"]
    for part in (1, 2):  # one lora_A shared by q, k and v
        np.testing.assert_array_equal(qkv_a[:, :, part * MAX_RANK : part * MAX_RANK + 8], qkv_a[:, :, :8])
    assert_deltas_match(adapter, peft_deltas(peft_model, config, PHI3_MODULES))


def test_in_memory_state_dicts_read_as_the_saved_adapter(tmp_path):
    peft_model, config = saved_adapter(tmp_path, r=8, lora_alpha=16, target_modules=ALL_LLAMA)
    saved = read_adapter(tmp_path, config, MAX_RANK)
    adapter_config = json.loads((tmp_path / "adapter_config.json").read_text())
    with_default = {k: v for k, v in peft_model.state_dict().items() if ".lora_" in k}
    assert any(".default." in name for name in with_default)
    for tensors in (get_peft_model_state_dict(peft_model), with_default):
        adapter = adapter_from_tensors(tensors, adapter_config, config, MAX_RANK)
        assert adapter.rank == saved.rank
        for matrix, weights in saved.weights.items():
            for side in "ab":
                np.testing.assert_array_equal(adapter.weights[matrix][side], weights[side])


def test_a_bfloat16_adapter_reads_as_float32(tmp_path):
    peft_model, config = saved_adapter(tmp_path, r=8, lora_alpha=16, target_modules=["q_proj"])
    peft_model.to(torch.bfloat16).save_pretrained(tmp_path)
    adapter = read_adapter(tmp_path, config, MAX_RANK)
    tensors = get_peft_model_state_dict(peft_model)  # torch bfloat16 tensors
    expected = adapter_from_tensors(tensors, adapter.config, config, MAX_RANK)
    assert adapter.weights["qkv"]["a"].dtype == np.float32
    np.testing.assert_array_equal(adapter.weights["qkv"]["b"], expected.weights["qkv"]["b"])


@pytest.fixture(scope="module")
def llama_adapter(tmp_path_factory):
    """A saved llama adapter's tensors (numpy) and adapter_config, and the model's config."""
    path = tmp_path_factory.mktemp("adapter")
    peft_model, config = saved_adapter(path, r=8, lora_alpha=16, target_modules=ALL_LLAMA)
    tensors = {k: v.detach().numpy() for k, v in get_peft_model_state_dict(peft_model).items()}
    return tensors, json.loads((path / "adapter_config.json").read_text()), config


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("peft_type", "IA3", "peft_type 'IA3'"),
        ("bias", "lora_only", "bias 'lora_only'"),
        ("use_dora", True, "use_dora"),
        ("lora_bias", True, "lora_bias"),
        ("modules_to_save", ["lm_head"], "modules_to_save"),
    ],
)
def test_adapters_that_are_not_plain_lora_are_refused_naming_the_field(llama_adapter, field, value, match):
    tensors, adapter_config, config = llama_adapter
    with pytest.raises(ValueError, match=match):
        adapter_from_tensors(tensors, {**adapter_config, field: value}, config, MAX_RANK)


def test_a_rank_above_max_lora_rank_is_refused(llama_adapter):
    tensors, adapter_config, config = llama_adapter
    with pytest.raises(ValueError, match="rank 8, which exceeds max_lora_rank 4"):
        adapter_from_tensors(tensors, adapter_config, config, 4)


def renamed(tensors: dict, old: str, new: str) -> dict:
    return {name.replace(old, new): tensor for name, tensor in tensors.items()}


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ("base_model.model.lm_head", r"'lm_head' is not supported; jpaged supports LoRA on q_proj, k_proj"),
        ("base_model.model.model.embed_tokens", "'model.embed_tokens' is not supported"),
        ("base_model.model.model.layers.0.mlp.gate", r"'model.layers.0.mlp.gate' is not supported"),
    ],
)
def test_modules_jpaged_does_not_adapt_are_refused_naming_them(llama_adapter, extra, match):
    tensors, adapter_config, config = llama_adapter
    a, b = np.zeros((8, 64), np.float32), np.zeros((64, 8), np.float32)
    unsupported = {f"{extra}.lora_A.weight": a, f"{extra}.lora_B.weight": b}
    with pytest.raises(ValueError, match=match):
        adapter_from_tensors({**tensors, **unsupported}, adapter_config, config, MAX_RANK)


def test_lora_embedding_weights_are_refused(llama_adapter):
    tensors, adapter_config, config = llama_adapter
    embedding = {"base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((8, 49152), np.float32)}
    with pytest.raises(ValueError, match="lora_embedding_A' is not supported"):
        adapter_from_tensors({**tensors, **embedding}, adapter_config, config, MAX_RANK)


def test_a_mixture_of_experts_mlp_module_is_refused(llama_adapter):
    tensors, adapter_config, _ = llama_adapter
    class_name, kwargs = TINY_FAMILIES["qwen3_moe"]
    moe = ModelConfig.from_hf_config(getattr(transformers, class_name)(**kwargs).to_dict())
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_proj' is not supported.* q_proj"):
        adapter_from_tensors(tensors, adapter_config, moe, MAX_RANK)


def test_a_layer_past_the_model_is_refused(llama_adapter):
    tensors, adapter_config, config = llama_adapter
    with pytest.raises(ValueError, match="'model.layers.5.self_attn.q_proj' is in layer 5; the model has 2"):
        adapter_from_tensors(renamed(tensors, "layers.1.", "layers.5."), adapter_config, config, MAX_RANK)


def test_shapes_that_do_not_fit_the_model_are_refused_naming_expected_and_got(llama_adapter):
    tensors, adapter_config, config = llama_adapter
    name = "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"
    cut = {**tensors, name: tensors[name][:16]}
    with pytest.raises(
        ValueError,
        match=r"'model.layers.0.self_attn.k_proj' .*expected lora_A \[r, 64\] and lora_B \[32, r\], "
        r"got \[8, 64\] and \[16, 8\]",
    ):
        adapter_from_tensors(cut, adapter_config, config, MAX_RANK)


def test_a_lora_a_without_its_lora_b_is_refused(llama_adapter):
    tensors, adapter_config, config = llama_adapter
    name = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    alone = {k: v for k, v in tensors.items() if k != name}
    with pytest.raises(ValueError, match="'model.layers.1.mlp.up_proj' has a lora_A without its lora_B"):
        adapter_from_tensors(alone, adapter_config, config, MAX_RANK)


def test_a_missing_adapter_file_names_its_path(tmp_path):
    _, config = tiny_model("llama")
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        read_adapter(tmp_path / "nowhere", config, MAX_RANK)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "adapter_model.safetensors")):
        read_adapter(tmp_path, config, MAX_RANK)


def test_tensors_whose_rank_is_not_the_configured_r_are_refused(llama_adapter):
    tensors, adapter_config, config = llama_adapter
    with pytest.raises(ValueError, match=r"has rank 8; its adapter_config \(r, rank_pattern\) says 4"):
        adapter_from_tensors(tensors, {**adapter_config, "r": 4}, config, MAX_RANK)


def test_an_adapter_without_lora_weights_is_refused(llama_adapter):
    _, adapter_config, config = llama_adapter
    with pytest.raises(ValueError, match="holds no lora_A / lora_B weights"):
        adapter_from_tensors({}, adapter_config, config, MAX_RANK)
