"""A GGUF's quantized matrices held as their blocks (GroupedMatrix), as the engine serves a GGUF by default: the
CPU kernel's logits are those of XLA's dequantise-then-dot and of the model dequantised at load (--quantization
none), on tiny Phi-3 (untied LM head, the MLP's gated form) and Gemma 3 (tied embedding, GeGLU) GGUFs of each block
type and on the embedded model; the embedded model is served from its blocks, in no more bytes than its file, and compiles nothing after warm-up; the conversion cache keeps each form apart."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_gguf_families import gguf_of  # noqa: F401 (a fixture)
from test_models import PagedRun, relative_error

from jpaged import LLM, SamplingParams
from jpaged.config import EngineConfig
from jpaged.models import gguf_cache
from jpaged.models.grouped import GROUPED, GroupedMatrix, PackedCodes, host_dequantized
from jpaged.models.loader import load_model
from jpaged.runner.weight_layout import GroupedPanels, held_weight_bytes

ARGS = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory=2**26)


def _runs(loaded_blocks, loaded_float, num_seqs: int = 2) -> list[PagedRun]:
    """The kernel's run (panels), XLA's dequantise-then-dot and the float model's, over the same prompts."""
    return [
        PagedRun(loaded_blocks, num_seqs, layout="panels"),
        PagedRun(loaded_blocks, num_seqs, products=GROUPED),
        PagedRun(loaded_float, num_seqs),
    ]


def _assert_same_logits(runs: list[PagedRun], vocab_size: int, tolerance: float = 1e-3) -> None:
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(0, vocab_size, n))) for n in (7, 30)]
    for starts, ends in (([0, 0], [5, 28]), ([5, 28], [7, 30])):  # a ragged prefill, then two decodes each
        kernel, xla, dequantised = (run.step(prompts, starts, ends) for run in runs)
        for got, reference, loaded_as_float in zip(kernel, xla, dequantised, strict=True):
            assert relative_error(got, reference) < tolerance
            assert relative_error(got, loaded_as_float) < tolerance


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("family", ["phi3", "gemma3"])
def test_blocks_give_the_logits_of_dequantise_then_dot_and_of_the_dequantised_model(family, qtype, gguf_of):  # noqa: F811
    path = str(gguf_of(family, qtype=qtype))
    blocks = load_model(path, progress=False, keep_blocks=True)
    layers = blocks.params["layers"]
    for matrix in (layers["attn"]["qkv"], layers["mlp"]["down"], blocks.params["embed"]["weight"]):
        assert isinstance(matrix, GroupedMatrix) and matrix.bits == (8 if qtype == "Q8_0" else 4)
    assert blocks.params["embed"]["weight"].shape == (blocks.config.vocab_size, blocks.config.hidden_size)
    floats = load_model(path, progress=False)
    np.testing.assert_array_equal(
        host_dequantized(layers["mlp"]["gate_up"]), floats.params["layers"]["mlp"]["gate_up"]
    )
    runs = _runs(blocks, floats)
    assert isinstance(runs[0].params["layers"]["mlp"]["gate_up"], GroupedPanels)
    held = runs[1].params["layers"]["mlp"]["gate_up"]  # XLA's: 4-bit codes two to a byte
    assert isinstance(held, PackedCodes if qtype != "Q8_0" else GroupedMatrix)
    assert held.codes.nbytes == layers["mlp"]["gate_up"].codes.nbytes // (2 if qtype != "Q8_0" else 1)
    _assert_same_logits(runs, blocks.config.vocab_size)


@pytest.fixture(scope="module")
def embedded_blocks():
    return load_model(None, progress=False, keep_blocks=True)


def test_the_embedded_models_blocks_give_the_logits_of_dequantise_then_dot(embedded_blocks):
    floats = load_model(None, progress=False)
    _assert_same_logits(_runs(embedded_blocks, floats), embedded_blocks.config.vocab_size)


def test_the_embedded_model_is_held_in_no_more_bytes_than_its_gguf_file(embedded_blocks):
    """Q4_1 layers and a Q8_0 embedding as the file stores them (its float16 scales and minimums, float32 norms):
    0.366 of the same model's bfloat16 bytes. The file's own blocks take that much, so the issue's 0.35 is out of
    reach of any form that keeps them (it took the file for 76 MB; it is 98 MB)."""
    bf16 = jax.tree_util.tree_map(
        lambda a: np.asarray(a, jnp.bfloat16), load_model(None, progress=False).params
    )
    float_bytes = sum(held_weight_bytes(bf16, "silu", None).values())
    held = held_weight_bytes(embedded_blocks.params, "silu", None)
    assert (
        held["uint8"] > 0 and held["int8"] > 0 and held["float16"] > 0
    )  # Q4_1 codes, Q8_0 codes, their scales
    assert sum(held.values()) <= embedded_blocks.source.path.stat().st_size
    assert sum(held.values()) < 0.37 * float_bytes


def test_the_engine_serves_a_gguf_from_its_blocks_unless_told_none_and_compiles_nothing_after_warm_up():
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    for quantization, held_as in ((None, GroupedPanels), ("none", jax.Array)):
        llm = LLM(quantization=quantization, **ARGS)
        assert isinstance(llm.engine.runner.params["layers"]["mlp"]["gate_up"], held_as)
        compiled = llm.metrics()["num_compilations"]
        (answer,) = llm.generate(["The capital of France is"], greedy, use_tqdm=False)
        assert "Paris" in answer.outputs[0].text
        mixed = [greedy, SamplingParams(max_tokens=6, n=2, temperature=0.8, seed=3, logprobs=2)]
        llm.generate(["one two three", "a longer prompt " * 12], mixed, use_tqdm=False)
        assert llm.metrics()["num_compilations"] == compiled


def test_the_conversion_cache_keeps_blocks_and_floats_apart(gguf_of):  # noqa: F811
    path = gguf_of("gemma3", qtype="Q4_1")
    first = load_model(str(path), progress=False, keep_blocks=True)
    assert gguf_cache.converted_dir(path, blocks=True) != gguf_cache.converted_dir(path)
    assert (
        gguf_cache.converted_dir(path, blocks=True).exists() and not gguf_cache.converted_dir(path).exists()
    )
    again = load_model(str(path), progress=False, keep_blocks=True)
    for a, b in zip(
        jax.tree_util.tree_leaves(first.params), jax.tree_util.tree_leaves(again.params), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    embed = again.params["embed"]["weight"]
    assert embed.transposed and embed.bits == 4 and embed.dtype == np.float32


def test_tensor_parallelism_reads_the_blocks_whole_on_the_host(gguf_of):  # noqa: F811
    """Lazy loading (tensor parallelism's) keeps the blocks, read whole; each device is then given its part."""
    loaded = load_model(str(gguf_of("phi3", qtype="Q4_0")), progress=False, keep_blocks=True, lazy=True)
    qkv = loaded.params["layers"]["attn"]["qkv"]
    assert isinstance(qkv, GroupedMatrix) and isinstance(qkv.codes, np.ndarray)


def test_a_quantization_jpaged_cannot_hold_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match="quantization must be one of.*none"):
        EngineConfig(quantization="int4")
