"""HF checkpoints shipped quantized are served kept as stored: every matrix stands for exactly what the format's own
library dequantises it to; the kernels give the logits of the XLA dequantise-then-dot form; weight-only formats give
transformers' logits of the dequantised model; the engine serves them with nothing compiled after warm-up,
`--quantization none` dequantises them at load and tensor parallelism splits them as stored. A calibrated W8A8
checkpoint's static activation scales are applied as vLLM applies them (one scale a matrix, a fused matrix's the
largest of its parts').

Checkpoints: llm-compressor writes the compressed-tensors ones (its preset schemes and a static int8 one it has no
preset for, calibrated on a few in-memory texts where activation scales are static); the FP8 block one (Qwen3-FP8
and DeepSeek's `quant_method: fp8`) is quantised here in torch; AWQ and GPTQ by tests/quantized_checkpoints.py.
References: compressed-tensors' own `dequantize` and FP8BlockDequantizer, its AutoAWQ converter, and the GPTQ
writer's dequantised weights.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_models import PagedRun, relative_error

from jpaged import LLM, SamplingParams
from jpaged.models.grouped import GroupedMatrix
from jpaged.models.loader import load_model
from jpaged.models.params import dequantized
from jpaged.models.quantized import QuantizedMatrix, QuantizedProducts, quantize, quantized_matmul
from jpaged.runner.gpu_grouped_layout import KernelGroupedMatrix, KernelGroupedProducts
from jpaged.runner.weight_layout import GroupedPanels

pytest.importorskip("llmcompressor")
torch = pytest.importorskip("torch")

SHAPE = dict(
    hidden_size=256,  # group and block sizes are 128
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    vocab_size=49152,  # the default tokenizer's
)
MATRICES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj") + tuple(
    f"mlp.{m}_proj" for m in ("gate", "up", "down")
)
# llm-compressor's preset scheme (or one of SCHEMES) -> how jpaged keeps its matrices, and whether activations stay
# in float (W*A16).
COMPRESSED = {
    "W4A16": (GroupedMatrix, True),
    "W4A16_ASYM": (GroupedMatrix, True),
    "W8A16": (GroupedMatrix, True),
    "W8A8": (QuantizedMatrix, False),
    "W8A8_STATIC": (QuantizedMatrix, False),
    "FP8_DYNAMIC": (QuantizedMatrix, False),
    "FP8": (QuantizedMatrix, False),  # static activation scales a tensor
    "FP8_BLOCK": (GroupedMatrix, True),  # weights dequantised where used (activations kept in float)
}
# Schemes llm-compressor has no preset for, as its QuantizationModifier's config groups: int8 W8A8 with static
# activation scales a tensor (vLLM serves it as it does the FP8 preset).
SCHEMES = {
    "W8A8_STATIC": dict(
        targets=["Linear"],
        weights=dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
        input_activations=dict(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False),
    )
}
STATIC = ("W8A8_STATIC", "FP8")  # calibrated: their activation scales are fixed at quantisation
FORMATS = [*COMPRESSED, "fp8_blocks", "awq", "gptq", "gptq_act_order"]
ARGS = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory=2**22)


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory, default_tokenizer) -> Path:
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**SHAPE), dtype=torch.float32
    )
    path = tmp_path_factory.mktemp("quantized") / "float"
    model.save_pretrained(path)
    default_tokenizer.save_pretrained(path)
    return path


@functools.cache
def _checkpoint(form: str, float_dir: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """The checkpoint of `form` and the float32 matrices its library dequantises it to, by module name."""
    out = float_dir.parent / form
    if form in COMPRESSED:
        return _compressed(form, float_dir, out)
    if form == "fp8_blocks":
        return _fp8_blocks(float_dir, out)
    from quantized_checkpoints import write_awq, write_gptq

    written = (
        write_awq(float_dir, out) if form == "awq" else write_gptq(float_dir, out, desc_act="act" in form)
    )
    return written, _weights(written / "dequantized")


def _weights(model_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    return {name.removesuffix(".weight"): w for name, w in tensors.items() if name.endswith("_proj.weight")}


def _quantized_model(scheme: str, float_dir: Path):
    """The float model quantised by llm-compressor with `scheme`, calibrated where its activation scales are static
    (on a few texts held in memory: there is no hub to fetch a data set from)."""
    import datasets
    import transformers
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    preset = dict(targets="Linear", scheme=scheme)
    groups = dict(config_groups=dict(group_0=SCHEMES[scheme])) if scheme in SCHEMES else preset
    recipe = QuantizationModifier(**groups, ignore=["lm_head"])
    calibration = {}
    if scheme in STATIC:
        texts = [
            "The capital of France is Paris.",
            "def add(a, b):\n    return a + b",
            "one two three four " * 8,
        ]
        tokens = transformers.AutoTokenizer.from_pretrained(float_dir)(texts)
        calibration = dict(
            dataset=datasets.Dataset.from_dict(dict(tokens)), num_calibration_samples=len(texts)
        )
    oneshot(model=model, recipe=recipe, **calibration)
    return model


def _compressed(scheme: str, float_dir: Path, out: Path) -> tuple[Path, dict[str, np.ndarray]]:
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    _quantized_model(scheme, float_dir).save_pretrained(out)
    shutil.copy(float_dir / "tokenizer.json", out)
    shutil.copy(float_dir / "tokenizer_config.json", out)
    # compressed-tensors' dequantisation of each module, from its quantised weight as the model holds it after
    # compression is undone (the library's own unpacking of the saved checkpoint is the test's other side).
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    args = QuantizationArgs(**next(iter(config["config_groups"].values()))["weights"])
    ref = _quantized_model(scheme, float_dir)
    expected = {}
    for name, module in ref.named_modules():
        if name.endswith(MATRICES):
            from compressed_tensors.quantization.lifecycle.forward import quantize

            zero = getattr(module, "weight_zero_point", None)
            q = quantize(module.weight, module.weight_scale, zero, args)
            expected[name] = dequantize(q, module.weight_scale, zero, args, dtype=torch.float32).numpy()
    return out, expected


def _fp8_blocks(float_dir: Path, out: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """128 x 128 blocks, each scaled so its largest magnitude is e4m3's (448), as DeepSeek-V3's checkpoints are."""
    from compressed_tensors.entrypoints.convert import FP8BlockDequantizer
    from safetensors.torch import load_file, save_file

    shutil.copytree(float_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        w = tensors[name]
        blocks = w.reshape(w.shape[0] // 128, 128, w.shape[1] // 128, 128)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        tensors[name] = (blocks / scale[:, None, :, None]).reshape(w.shape).to(torch.float8_e4m3fn)
        tensors[name.replace(".weight", ".weight_scale_inv")] = scale
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = dict(
        quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128]
    )
    (out / "config.json").write_text(json.dumps(config))
    dense = FP8BlockDequantizer(targets=["re:.*_proj$"], dtype=torch.float32).process(dict(tensors))
    return out, {n.removesuffix(".weight"): dense[n].numpy() for n in dense if n.endswith("_proj.weight")}


@pytest.fixture(scope="module")
def checkpoint(float_dir):
    return lambda form: _checkpoint(form, float_dir)


def _matrix(params: dict, module: str) -> np.ndarray:
    """Module `model.layers.{i}.{m}` of the loaded params, dequantised, in transformers' [out, in]."""
    layer, name = int(module.split(".")[2]), module.split(".", 3)[3]
    q, kv = SHAPE["hidden_size"], SHAPE["hidden_size"] // 2
    attn, mlp = params["layers"]["attn"], params["layers"]["mlp"]
    columns = {
        "self_attn.q_proj": (attn["qkv"], 0, q),
        "self_attn.k_proj": (attn["qkv"], q, q + kv),
        "self_attn.v_proj": (attn["qkv"], q + kv, q + 2 * kv),
        "self_attn.o_proj": (attn["o"], 0, None),
        "mlp.gate_proj": (mlp["gate_up"], 0, SHAPE["intermediate_size"]),
        "mlp.up_proj": (mlp["gate_up"], SHAPE["intermediate_size"], None),
        "mlp.down_proj": (mlp["down"], 0, None),
    }
    stack, start, end = columns[name]
    return dequantized(stack)[layer][:, start:end].T


@pytest.mark.parametrize("form", FORMATS)
def test_each_matrix_is_kept_and_stands_for_what_its_library_dequantises(form, checkpoint):
    path, expected = checkpoint(form)
    loaded = load_model(str(path), progress=False, keep_blocks=True)
    kept = loaded.params["layers"]["mlp"]["down"]
    kind = COMPRESSED.get(form, (GroupedMatrix,))[0]
    if form == "gptq_act_order":  # inputs out of group order: dequantised at load
        assert isinstance(kept, np.ndarray)
    else:
        assert isinstance(kept, kind) and isinstance(loaded.params["layers"]["attn"]["qkv"], kind)
    for module, weight in expected.items():
        assert relative_error(_matrix(loaded.params, module), weight) < 1e-6, module
    dense = load_model(str(path), progress=False, keep_blocks=False).params["layers"]["mlp"]["down"]
    assert isinstance(dense, np.ndarray) and dense.dtype == np.float32


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_a_static_activation_scale_quantises_every_token_by_that_one_scale(scheme):
    """vLLM's static W8A8, written out in numpy float64: x / input_scale clipped to the format's range (rounded, for
    int8), the sums scaled back by input_scale and the columns' scales; both forms of the product give it, and the
    per-token product does not."""
    rng = np.random.default_rng(5)
    sizes = np.geomspace(0.05, 5, 6)[:, None]  # tokens of all sizes
    x = (rng.standard_normal((6, 256)) * sizes).astype(np.float32)
    weight = quantize(rng.standard_normal((256, 24)).astype(np.float32), scheme)
    low, high = {"int8": (-128, 127), "fp8": (-448, 448)}[scheme]
    input_scale = np.full((1, 1), np.abs(x).max() / 4 / high, np.float32)  # the largest tokens clip
    static = QuantizedMatrix(weight.values, weight.scale, input_scale)
    assert static.T.input_scale is input_scale and static.scheme == scheme
    scaled = x.astype(np.float64) / input_scale
    xq = np.clip(np.round(scaled) if scheme == "int8" else scaled, low, high)
    if scheme == "fp8":
        xq = xq.astype(jnp.float8_e4m3fn).astype(np.float64)
    expected = xq @ np.asarray(weight.values, np.float64) * input_scale * np.asarray(weight.scale, np.float64)
    for reference in (False, True):
        got = np.asarray(quantized_matmul(jnp.asarray(x), static, scheme, reference))
        assert relative_error(got, expected) < 1e-6
    assert relative_error(np.asarray(quantized_matmul(jnp.asarray(x), weight, scheme)), expected) > 0.1


def test_fused_matrices_take_the_largest_static_scale_of_their_parts(checkpoint, tmp_path):
    """q, k and v (gate and up) read one input and are multiplied as one matrix: its one activation scale is the
    largest of theirs (vLLM's rule), which clips none of their calibrated ranges."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "FP8"
    shutil.copytree(checkpoint("FP8")[0], path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_proj.input_scale"] *= 3  # one layer's parts calibrated apart
    tensors["model.layers.0.mlp.up_proj.input_scale"] *= 2
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    layers = load_model(str(path), progress=False, keep_blocks=True).params["layers"]
    fused = [
        (layers["attn"]["qkv"], ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        (layers["mlp"]["gate_up"], ("mlp.gate_proj", "mlp.up_proj")),
    ]
    for matrix, parts in fused:
        assert matrix.input_scale.shape == (SHAPE["num_hidden_layers"], 1, 1)
        for layer in range(SHAPE["num_hidden_layers"]):
            largest = max(float(tensors[f"model.layers.{layer}.{part}.input_scale"]) for part in parts)
            assert float(matrix.input_scale[layer, 0, 0]) == largest


def test_the_awq_writer_agrees_with_compressed_tensors_converter(checkpoint):
    from quantized_checkpoints import awq_matches_compressed_tensors

    assert awq_matches_compressed_tensors(checkpoint("awq")[0])


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [list(map(int, rng.integers(0, vocab, n))) for n in (7, 30)]


# One checkpoint a kernel path: the grouped kernel's 4- and 8-bit codes (and AWQ's zeros), the int8 kernel, XLA's fp8
# dot, XLA's dots with static activation scales (int8 ones too: the CPU int8 kernel quantises per token). Block-scaled
# FP8 is dequantised the XLA way whatever the layout, so it has no second form to compare.
@pytest.mark.parametrize("form", ["W4A16", "W8A16", "awq", "W8A8", "FP8_DYNAMIC", *STATIC])
def test_the_kernels_give_the_logits_of_dequantise_then_dot(form, checkpoint):
    loaded = load_model(str(checkpoint(form)[0]), progress=False, keep_blocks=True)
    prompts = _prompts(loaded.config.vocab_size)
    if isinstance(loaded.params["layers"]["mlp"]["down"], QuantizedMatrix):
        scheme = loaded.params["layers"]["mlp"]["down"].scheme
        runs = [
            PagedRun(loaded, 2, layout="auto"),
            PagedRun(loaded, 2, products=QuantizedProducts(scheme=scheme, reference=True)),
        ]
    else:
        runs = [PagedRun(loaded, 2, layout=layout) for layout in ("auto", "stacked")]
    for starts, ends in (([0, 0], [5, 28]), ([5, 28], [7, 30])):
        ours, reference = (run.step(prompts, starts, ends) for run in runs)
        for got, expected in zip(ours, reference, strict=True):
            assert relative_error(got, expected) < 1e-3


@pytest.mark.parametrize("form", ["W4A16", "W8A16", "fp8_blocks"])
def test_the_gpu_kernel_gives_the_logits_of_dequantise_then_dot(form, checkpoint):
    """In Pallas' interpret mode: the kernel takes every layer matrix (4-bit, 8-bit and float8 codes)."""
    loaded = load_model(str(checkpoint(form)[0]), progress=False, keep_blocks=True)
    prompts = _prompts(loaded.config.vocab_size)
    runs = [PagedRun(loaded, 2, products=KernelGroupedProducts(interpret=True)), PagedRun(loaded, 2)]
    assert isinstance(runs[0].params["layers"]["mlp"]["gate_up"], KernelGroupedMatrix)
    for starts, ends in (([0, 0], [5, 28]), ([5, 28], [7, 30])):
        ours, reference = (run.step(prompts, starts, ends) for run in runs)
        for got, expected in zip(ours, reference, strict=True):
            assert relative_error(got, expected) < 1e-3


@pytest.mark.parametrize("form", [f for f in FORMATS if COMPRESSED.get(f, (None, True))[1]])
def test_weight_only_formats_give_transformers_logits_of_the_dequantised_model(form, checkpoint, float_dir):
    """transformers runs the float model with each matrix replaced by its library's dequantisation."""
    import transformers
    from conftest import hf_logits

    path, expected = checkpoint(form)
    model = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    for name, module in model.named_modules():
        if name in expected:
            module.weight.data = torch.from_numpy(expected[name])
    dense = float_dir.parent / f"{form}-dense"
    model.save_pretrained(dense)
    loaded = load_model(str(path), progress=False, keep_blocks=True)
    (prompt,) = _prompts(loaded.config.vocab_size)[1:]
    (ours,) = PagedRun(loaded, 1, layout="auto").step([prompt], [0], [len(prompt)])
    assert relative_error(ours, hf_logits(dense, prompt)) < 1e-3


@pytest.mark.parametrize(
    ("form", "held_as"), [("W4A16", GroupedPanels), ("W8A8", QuantizedMatrix), ("FP8", QuantizedMatrix)]
)
def test_the_engine_serves_a_quantized_checkpoint_and_compiles_nothing_after_warm_up(
    form, held_as, checkpoint
):
    path = str(checkpoint(form)[0])
    prompts = [{"prompt_token_ids": p} for p in _prompts(SHAPE["vocab_size"])]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    mixed = [greedy, SamplingParams(max_tokens=5, n=2, temperature=0.8, seed=3, logprobs=2)]
    for quantization, held in ((None, held_as), ("none", jax.Array)):
        llm = LLM(model=path, quantization=quantization, **ARGS)
        assert isinstance(llm.engine.runner.params["layers"]["mlp"]["down"], held)
        compiled = llm.metrics()["num_compilations"]
        llm.generate(prompts, greedy, use_tqdm=False)
        llm.generate(prompts, mixed, use_tqdm=False)
        assert llm.metrics()["num_compilations"] == compiled


@pytest.mark.parametrize(
    ("form", "held", "tolerance"),
    [
        ("W4A16", "PackedCodes", 1e-5),
        ("W8A8", "QuantizedMatrix", 1e-3),
        ("FP8", "QuantizedMatrix", 1e-3),  # static activation scales, on every device whole
        ("fp8_blocks", "GroupedMatrix", 1e-5),
    ],
)
def test_tensor_parallelism_splits_a_checkpoints_matrices_as_stored_and_generates_as_one_device(
    form, held, tolerance, checkpoint
):
    """Each device holds its part of the codes and their scales (W8A8: see
    test_tensor_parallel.test_matrices_quantized_on_the_devices_split_two_ways_generate_as_one_device)."""
    from test_tensor_parallel import assert_same_as_one_device, generate

    runs = generate(str(checkpoint(form)[0]), 1, 2, quantization="kept")
    assert_same_as_one_device(runs, 2, tolerance)
    assert held in runs["2"]["held"]


def _static_activations(**change) -> dict:
    """A change to the FP8 preset's (static) input activations."""
    return dict(config_groups=dict(group_0=dict(input_activations=change)))


# k_proj with dynamic activations, fused with static q and v.
_DYNAMIC_K = dict(
    config_groups=dict(
        dynamic_k=dict(
            targets=["re:.*k_proj$"],
            weights=dict(num_bits=8, type="float", strategy="tensor"),
            input_activations=dict(num_bits=8, type="float", strategy="token", dynamic=True),
        )
    )
)


def _merge(config: dict, change: dict) -> None:
    """`change` written into `config`, a dict in it merged into the one there."""
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            _merge(config[key], value)
        else:
            config[key] = value


@pytest.mark.parametrize(
    ("form", "change", "message"),
    [
        ("W4A16", dict(quant_method="bitsandbytes"), "quant_method 'bitsandbytes' is not supported"),
        ("W4A16", dict(sparsity_config=dict(format="sparse-24-bitmask")), "sparsity_config format"),
        ("awq", dict(version="gemv"), "version='gemv'"),
        ("fp8_blocks", dict(fmt="e5m2"), "fmt 'e5m2'"),
        ("fp8_blocks", dict(activation_scheme="static"), "activation_scheme 'static' with weight_block_size"),
        ("fp8_blocks", dict(activation_scheme="per_token"), "activation_scheme 'per_token'"),
        ("FP8", _static_activations(strategy="group", group_size=128), "input_activations strategy 'group'"),
        ("FP8", _static_activations(strategy="token"), "input_activations strategy 'token'"),
        ("FP8", _static_activations(symmetric=False), "input_activations symmetric false"),
        ("FP8", _DYNAMIC_K, "k_proj.weight.*mixing static activation scales"),
    ],
)
def test_a_quantization_config_jpaged_cannot_read_is_a_value_error_naming_its_field(
    form, change, message, checkpoint, tmp_path
):
    path = tmp_path / form
    shutil.copytree(checkpoint(form)[0], path)
    config = json.loads((path / "config.json").read_text())
    _merge(config["quantization_config"], change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_model(str(path), progress=False, keep_blocks=True)


@pytest.mark.parametrize("form", ["W4A16", "W8A8", "FP8"])
def test_convert_writes_the_matrices_kept_and_the_orbax_checkpoint_restores_them_as_they_were(
    form, checkpoint, tmp_path
):
    from jpaged.entrypoints.cli import main

    source = str(checkpoint(form)[0])
    assert main(["convert", source, str(tmp_path / "kept")]) == 0
    assert main(["convert", source, str(tmp_path / "float"), "--dequantize"]) == 0
    loaded = load_model(source, progress=False, keep_blocks=True)
    restored = load_model(str(tmp_path / "kept"), progress=False, keep_blocks=True)
    is_matrix = lambda x: isinstance(x, GroupedMatrix | QuantizedMatrix)  # noqa: E731
    pairs = zip(
        jax.tree_util.tree_leaves(loaded.params, is_leaf=is_matrix),
        jax.tree_util.tree_leaves(restored.params, is_leaf=is_matrix),
        strict=True,
    )
    for ours, theirs in pairs:
        assert type(ours) is type(theirs)
        assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, ours, theirs))
    dense = load_model(str(tmp_path / "float"), progress=False, keep_blocks=True).params["layers"]["mlp"][
        "down"
    ]
    assert isinstance(dense, np.ndarray)
    assert relative_error(dense, dequantized(loaded.params["layers"]["mlp"]["down"])) < 1e-6


@pytest.mark.parametrize("activation_scheme", ["static", "dynamic"])
def test_an_fp8_checkpoint_with_a_scale_a_matrix_holds_what_compressed_tensors_fp8_holds(
    activation_scheme, checkpoint, tmp_path
):
    """`quant_method: fp8` without blocks, as AutoFP8 writes it (`weight_scale` a matrix, `input_scale` where
    activations are static) and vLLM reads it: the FP8 preset's own tensors under that config load as the same
    matrices, their input scales applied only where the scheme is static."""
    from safetensors.numpy import load_file, save_file

    source = checkpoint("FP8")[0]
    out = tmp_path / "autofp8"
    shutil.copytree(source, out)
    tensors = load_file(out / "model.safetensors")
    if activation_scheme == "dynamic":
        tensors = {name: t for name, t in tensors.items() if not name.endswith(".input_scale")}
    save_file(tensors, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = dict(quant_method="fp8", activation_scheme=activation_scheme)
    (out / "config.json").write_text(json.dumps(config))
    ours, theirs = (
        load_model(str(d), progress=False, keep_blocks=True).params["layers"] for d in (out, source)
    )
    for parent, name in (("attn", "qkv"), ("attn", "o"), ("mlp", "gate_up"), ("mlp", "down")):
        mine, expected = ours[parent][name], theirs[parent][name]
        np.testing.assert_array_equal(mine.values, expected.values)
        np.testing.assert_array_equal(mine.scale, expected.scale)
        if activation_scheme == "static":
            np.testing.assert_array_equal(mine.input_scale, expected.input_scale)
        else:
            assert mine.input_scale is None
