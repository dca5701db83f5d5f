"""A checkpoint's KV cache scales (compressed-tensors' `kv_cache_scheme`: a k_scale and a v_scale a layer) are read
and applied to float8 pages: K and V are stored divided by them and read back times them, so a model whose K and V
reach far past e4m3's range (448) keeps the float pool's logits, where the same pages without the scales saturate;
a float pool ignores them, and the engine's attention reads scaled pages as the XLA reference does."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_models import BLOCK, PagedRun, relative_error

from jpaged import LLM, SamplingParams
from jpaged.models.llama import init_kv_cache
from jpaged.models.loader import load_model

GROWTH = (
    1e4  # K and V this many times the tiny model's (q and o shrunk to match: the float model is unchanged)
)
SCALE = 100.0  # the checkpoint's scale: K / SCALE and V / SCALE sit well inside e4m3's range


@pytest.fixture(scope="module")
def scaled_dir(tiny_llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("kv_scales") / "llama"
    shutil.copytree(tiny_llama_dir, path)
    tensors = load_file(str(path / "model.safetensors"))
    factors = {"k_proj": GROWTH, "v_proj": GROWTH, "q_proj": 1 / GROWTH, "o_proj": 1 / GROWTH}
    for name in list(tensors):
        module = name.split(".")[-2]
        if module in factors:
            tensors[name] = (tensors[name] * factors[module]).astype(np.float32)
        if module == "k_proj" and name.endswith("weight"):
            for kind in ("k_scale", "v_scale"):
                tensors[name.replace("k_proj.weight", kind)] = np.asarray(SCALE, np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = dict(
        quant_method="compressed-tensors",
        format="dense",
        config_groups={},
        quantization_status="compressed",
        kv_cache_scheme=dict(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True),
    )
    (path / "config.json").write_text(json.dumps(config))
    return path


def _logits(loaded, pool_dtype) -> list[np.ndarray]:
    run = PagedRun(loaded, 2)
    run.cache = init_kv_cache(loaded.config, 1 + 2 * run.width, BLOCK, pool_dtype)
    prompts = [list(range(100, 107)), list(range(3000, 3030))]
    run.step(prompts, [0, 0], [5, 28])
    return run.step(prompts, [5, 28], [7, 30])


def test_float8_pages_with_the_checkpoints_scales_keep_the_float_pools_logits(scaled_dir):
    loaded = load_model(str(scaled_dir), progress=False)
    assert loaded.config.kv_cache_scales
    assert np.array_equal(loaded.params["layers"]["attn"]["kv_scales"], np.full((2, 2), SCALE, np.float32))
    floats = _logits(loaded, jnp.float32)
    scaled = _logits(loaded, jnp.float8_e4m3fn)
    params = dict(loaded.params, layers=dict(loaded.params["layers"]))
    params["layers"]["attn"] = {k: v for k, v in params["layers"]["attn"].items() if k != "kv_scales"}
    unscaled_model = dataclasses.replace(
        loaded, config=dataclasses.replace(loaded.config, kv_cache_scales=False), params=params
    )
    unscaled = _logits(unscaled_model, jnp.float8_e4m3fn)
    for with_scales, without, expected in zip(scaled, unscaled, floats, strict=True):
        assert relative_error(with_scales, expected) < 0.05
        assert relative_error(without, expected) > 0.2  # K and V saturated at 448


def test_the_engines_attention_reads_scaled_pages_as_the_reference_and_compiles_nothing_after_warm_up(
    scaled_dir,
):
    args = dict(
        model=str(scaled_dir), kv_cache_dtype="fp8", max_model_len=128, max_num_seqs=4, kv_cache_memory=2**22
    )
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 130 + 7 * i))} for i in range(3)]
    engines = [LLM(**args), LLM(attention_impl="reference", **args)]
    compiled = engines[0].metrics()["num_compilations"]
    tokens = [
        [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] for llm in engines
    ]
    assert tokens[0] == tokens[1]
    assert engines[0].metrics()["num_compilations"] == compiled
