"""Online quantization (vLLM's `--quantization int8` and `fp8`, W8A8 with per-token activation scales): the layer
matrices are held as int8 / float8 with a scale per column, their native dots give the logits of the XLA
dequantise-then-dot form, the quantized model still answers as the float one does, nothing compiles after warm-up,
and what cannot be run is refused naming the field."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_models import PagedRun, relative_error

from jpaged import LLM, SamplingParams
from jpaged.config import EngineConfig
from jpaged.models.loader import load_model
from jpaged.models.products import LAYER_MATRICES
from jpaged.models.quantized import (
    QuantizedMatrix,
    QuantizedProducts,
    quantize,
    quantize_rows,
    quantized_matmul,
)
from jpaged.runner.weight_layout import Int8PanelProducts

SCHEMES = ("int8", "fp8")
ARGS = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def embedded():
    return load_model(None, dtype=jnp.float32, progress=False)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_matrix_is_held_in_its_format_with_a_scale_per_column_that_reproduces_it(scheme):
    w = np.random.default_rng(0).standard_normal((3, 40, 24)).astype(np.float32) * np.linspace(0.1, 9, 24)
    m = quantize(w, scheme)
    assert (
        m.values.dtype == {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[scheme] and m.values.shape == w.shape
    )
    assert m.scale.shape == (3, 1, 24) and m.scale.dtype == jnp.float32
    back = np.asarray(m.values, np.float32) * np.asarray(m.scale)
    # Half of int8's step (the column's largest / 127); e4m3 rounds to 3 mantissa bits: within 1/16 of the value.
    error = {"int8": np.abs(w).max(axis=1, keepdims=True) / 254, "fp8": np.abs(w) / 16}[scheme]
    assert np.all(np.abs(back - w) <= error + 1e-6)
    rows, scale = quantize_rows(jnp.asarray(w[0]), scheme)
    assert scale.shape == (40, 1) and rows.dtype == m.values.dtype


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", ["llama", "qwen2_bias", "gemma3"])
def test_native_dots_give_the_logits_of_dequantise_then_dot(family, scheme, tiny_model_dir):
    loaded = load_model(str(tiny_model_dir(family)), progress=False)
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(0, loaded.config.vocab_size, n))) for n in (7, 30)]
    runs = [
        PagedRun(loaded, 2, products=QuantizedProducts(scheme=scheme, reference=r)) for r in (False, True)
    ]
    for starts, ends in (([0, 0], [5, 28]), ([5, 28], [7, 30])):  # a ragged prefill, then two decodes each
        native, reference = (run.step(prompts, starts, ends) for run in runs)
        for got, expected in zip(native, reference, strict=True):
            assert relative_error(got, expected) < 1e-3
    layers = runs[0].params["layers"]
    assert isinstance(layers["attn"]["qkv"], QuantizedMatrix) and isinstance(
        layers["mlp"]["down"], QuantizedMatrix
    )


@pytest.mark.parametrize("family", ["llama", "qwen2_bias", "gemma3"])
def test_the_cpu_int8_kernel_gives_the_sums_of_xlas_int8_dots(family, tiny_model_dir):
    """Exact int32 sums either way: the layers' outputs are the same bits, the logits differ only by the LM head's
    float32 sums (the CPU panels' order against XLA's)."""
    loaded = load_model(str(tiny_model_dir(family)), progress=False)
    rng = np.random.default_rng(4)
    prompts = [list(map(int, rng.integers(0, loaded.config.vocab_size, n))) for n in (7, 30)]
    kernel = Int8PanelProducts.for_params(loaded.params, loaded.config.hidden_activation)
    runs = [PagedRun(loaded, 2, products=p) for p in (kernel, QuantizedProducts(scheme="int8"))]
    for starts, ends in (([0, 0], [5, 28]), ([5, 28], [7, 30])):
        ours, xla = (run.step(prompts, starts, ends) for run in runs)
        for got, expected in zip(ours, xla, strict=True):
            assert relative_error(got, expected) < 1e-5
    assert runs[0].params["layers"]["mlp"]["down"].values.ndim == 5  # [L, P, K / 4, 16, 4] panels


@pytest.mark.parametrize("scheme", SCHEMES)
def test_native_dots_give_dequantise_then_dot_on_every_matrix_of_the_embedded_model(scheme, embedded):
    """Matrix by matrix: over thirty layers, a last-bit difference in one product moves a later token's activation
    quantisation by a whole step, so whole-model logits of the two forms part by percents after such a token
    (measured: 1e-7 before it, 3-7% after), whichever form is right."""
    rng = np.random.default_rng(2)
    layers = embedded.params["layers"]
    for name, (parent, leaf) in LAYER_MATRICES.items():
        for layer in (0, embedded.config.num_layers - 1):
            weight = quantize(layers[parent][leaf][layer], scheme)
            x = jnp.asarray(rng.standard_normal((9, weight.shape[0])), jnp.float32)
            native, reference = (quantized_matmul(x, weight, scheme, r) for r in (False, True))
            assert relative_error(np.asarray(native), np.asarray(reference)) < 1e-6, (name, layer)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_embedded_model_quantized_answers_as_before_and_compiles_nothing_after_warm_up(scheme):
    llm = LLM(quantization=scheme, **ARGS)
    held = llm.engine.runner.params["layers"]["mlp"]["gate_up"]
    assert isinstance(held, QuantizedMatrix) and held.values.dtype.itemsize == 1
    compiled = llm.metrics()["num_compilations"]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    (answer,) = llm.generate(["The capital of France is"], greedy, use_tqdm=False)
    assert "Paris" in answer.outputs[0].text
    mixed = [greedy, SamplingParams(max_tokens=6, n=2, temperature=0.8, seed=3, logprobs=2)]
    llm.generate(["one two three", "a longer prompt " * 12], mixed, use_tqdm=False)
    assert llm.metrics()["num_compilations"] == compiled


def test_new_weights_are_quantized_as_they_arrive(tiny_llama):
    llm = LLM.from_params(
        tiny_llama.params, tiny_llama.config, tiny_llama.tokenizer, quantization="int8", **ARGS
    )
    compiled = llm.metrics()["num_compilations"]
    new = jax.tree_util.tree_map(lambda leaf: -np.asarray(leaf), tiny_llama.params)
    llm.update_weights(new)
    fresh = LLM.from_params(new, tiny_llama.config, tiny_llama.tokenizer, quantization="int8", **ARGS)
    prompts = [{"prompt_token_ids": list(range(100 + i, 130 + i))} for i in range(2)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = [[o.outputs[0].token_ids for o in engine.generate(prompts, greedy)] for engine in (llm, fresh)]
    assert tokens[0] == tokens[1]
    assert llm.metrics()["num_compilations"] == compiled


def test_a_quantization_jpaged_cannot_run_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize(("scheme", "operand"), [("fp8", "f8E4M3FN"), ("int8", "i8")])
def test_the_accelerators_dot_takes_the_quantized_operands_themselves(scheme, operand, platform):
    """Exported for each accelerator, the W8A8 product is one dot of e4m3 (or int8) operands summing in float32 (or
    int32): XLA hands it to the GPU's FP8/int8 GEMMs (cuBLASLt on Hopper) and the TPU's native dots, never a dot of
    widened weights. (What XLA's compiler does with it after export needs the device.)"""
    from lowering import export_text

    values = jax.ShapeDtypeStruct((4096, 1024), {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8}[scheme])
    args = [
        jax.ShapeDtypeStruct((16, 4096), jnp.bfloat16),
        values,
        jax.ShapeDtypeStruct((1, 1024), jnp.float32),
    ]
    text = export_text(lambda x, v, s: quantized_matmul(x, QuantizedMatrix(v, s), scheme), platform, args)
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    sums = {"fp8": "f32", "int8": "i32"}[scheme]
    assert len(dots) == 1
    assert f"(tensor<16x4096x{operand}>, tensor<4096x1024x{operand}>) -> tensor<16x1024x{sums}>" in dots[0]
