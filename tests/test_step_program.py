"""The programs a GPU runs each step branch and loop only as the host decided: XLA:GPU reads a conditional's
predicate back to the host, and a loop's on every trip when the device decides the trip count, and cannot capture
such a step as one command buffer (CUDA graph). Loops with a trip count fixed at trace time are scans, which it
runs without."""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lowering import TRITON_CALL, abstract_gpu, export_text

from jpaged.config import EngineConfig
from jpaged.engine.llm_engine import LLMEngine
from jpaged.models.llama import abstract_params, init_kv_cache, model_graphdef
from jpaged.models.products import STACKED
from jpaged.pallas import gpu, mosaic_gpu
from jpaged.runner.device_step import bind_step, copy_blocks
from jpaged.runner.packed_inputs import pack
from jpaged.runner.sampling_inputs import SamplingWidths, build_sampling_tensors, neutral_wide, split_wide
from jpaged.runner.step_batch import dummy_batch

BLOCK_SIZE = 16


def primitives(jaxpr) -> set[str]:
    """Every primitive of a jaxpr and its sub-jaxprs, kernels' insides excluded (they run on the device)."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if eqn.primitive.name == "pallas_call":
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's own
                if hasattr(sub, "eqns"):
                    names |= primitives(sub)
    return names


def cache_spec(config, num_blocks: int = 64):
    return jax.eval_shape(lambda: init_kv_cache(config, num_blocks, BLOCK_SIZE, jnp.bfloat16))


def whole_step(config, step, tokens: int, seqs: int, **sampling_options):
    """A step's two halves as one function, and its abstract args, in the bucket (tokens, seqs)."""
    widths = SamplingWidths(config.vocab_size, history_len=64)
    batch_packed, batch_layout = pack(dummy_batch(tokens, seqs, 8))
    sampling, _ = split_wide(build_sampling_tensors([], seqs, widths, **sampling_options))
    sampling_packed, sampling_layout = pack(sampling)
    bound = functools.partial(step.whole, batch_layout=batch_layout, sampling_layout=sampling_layout)
    last_tokens = jax.ShapeDtypeStruct((seqs,), jnp.int32)
    return bound, (
        abstract_params(config, jnp.bfloat16),
        cache_spec(config),
        last_tokens,
        batch_packed,
        sampling_packed,
        neutral_wide(seqs, widths),
    )


def gpu_steps(config, attention=gpu.ragged_paged_attention_stacked):
    """The step as a GPU runs it, with every sampling variant the host can choose, in a decode and a prefill
    bucket: (bound step, its abstract args)."""
    step = bind_step(model_graphdef(config), attention, STACKED, branch_free=True)
    for tokens, seqs in ((8, 8), (64, 4)):
        for truncation in (False, True):
            yield whole_step(config, step, tokens, seqs, truncation=truncation)


def test_the_gpu_step_has_no_branch_or_loop_that_the_device_decides(tiny_llama):
    for bound, args in gpu_steps(tiny_llama.config):
        found = primitives(jax.make_jaxpr(bound)(*args).jaxpr)
        assert "pallas_call" in found and "scan" in found  # the kernel, the layer scan: the walk sees them
        assert "sort" in found or "top_k" in found or "argmax" in found
        assert "while" not in found and "cond" not in found


def test_the_cpu_sampler_keeps_its_shortcuts_so_the_check_above_can_fail(tiny_llama):
    config = tiny_llama.config
    step = bind_step(model_graphdef(config), gpu.ragged_paged_attention_stacked, STACKED, branch_free=False)
    bound, args = whole_step(config, step, 8, 8)
    assert "cond" in primitives(jax.make_jaxpr(bound)(*args).jaxpr)


def test_the_gpu_step_exported_for_cuda_has_no_conditional(tiny_llama):
    for bound, args in gpu_steps(tiny_llama.config):
        text = export_text(bound, "cuda", args)
        assert TRITON_CALL in text
        assert "stablehlo.case" not in text and "stablehlo.if" not in text


@pytest.mark.parametrize(
    ("arch", "device_kind"), [("hopper", "NVIDIA H100 80GB HBM3"), ("blackwell", "NVIDIA B200")]
)
def test_the_gpu_step_with_the_mosaic_gpu_kernel_exported_for_cuda_calls_no_triton_and_has_no_conditional(
    tiny_llama, monkeypatch, arch, device_kind
):
    """What an H100 and a B200 run where jax has no Triton backend left (its import made to fail here)."""
    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)
    config = dataclasses.replace(tiny_llama.config, head_dim=64)  # the kernel's tiles take 64-element rows
    attention = functools.partial(mosaic_gpu.ragged_paged_attention_stacked, arch=arch)
    for bound, args in gpu_steps(config, attention):
        text = export_text(bound, "cuda", args, abstract_gpu(device_kind))
        assert mosaic_gpu.KERNEL_CALL in text and TRITON_CALL not in text
        assert "stablehlo.case" not in text and "stablehlo.if" not in text


def test_copy_on_write_copies_are_one_gather_and_scatter_of_a_shape_the_host_chose(tiny_llama):
    jaxpr = jax.make_jaxpr(copy_blocks)(cache_spec(tiny_llama.config), np.zeros((8, 2), np.int32))
    found = primitives(jaxpr.jaxpr)
    assert "scatter" in found and "while" not in found


def test_copies_beyond_a_program_are_made_in_chunks_and_touch_no_other_block(tiny_llama):
    config = EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, num_blocks=32, enforce_eager=True
    )
    runner = LLMEngine(config, model=tiny_llama).runner
    assert runner.shapes.copy_sizes == (1, 2, 4)
    rng = np.random.default_rng(0)
    blocks = list(range(1, 32))
    shape = runner.kv_cache.k[:, 1:].shape
    k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    runner.write_blocks(blocks, k, v)
    copies = [(src, src + 15) for src in range(1, 10)]  # nine: chunks of 4, 4 and 1
    runner.copy_blocks(copies)
    k_after, v_after = runner.read_blocks(blocks)
    expected_k, expected_v = k.copy(), v.copy()
    for src, dst in copies:
        expected_k[:, dst - 1], expected_v[:, dst - 1] = k[:, src - 1], v[:, src - 1]
    np.testing.assert_array_equal(k_after, expected_k)
    np.testing.assert_array_equal(v_after, expected_v)
