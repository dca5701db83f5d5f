"""Compiled steps saved to disk come back as working executables, without compiling again."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_driver import run_requests

from jpaged.config import EngineConfig
from jpaged.engine.llm_engine import LLMEngine
from jpaged.runner.executable_cache import ExecutableCache
from jpaged.sampling_params import SamplingParams


def _compile():
    """A small program with a donated buffer, like the engine's step."""

    def step(cache, x):
        return cache.at[0].add(x @ x.T), jnp.tanh(x).sum()

    return jax.jit(step, donate_argnums=0).lower(jnp.zeros((3, 4, 4)), jnp.ones((4, 2))).compile()


def _refuse():
    raise AssertionError("compiled again although the executable was saved")


def test_a_saved_executable_loads_in_a_new_cache_and_runs(tmp_path):
    first = ExecutableCache(tmp_path).get_or_compile(("step", 1), _compile)
    again = ExecutableCache(tmp_path).get_or_compile(("step", 1), _refuse)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 2)), jnp.float32)
    expected = first(jnp.zeros((3, 4, 4)), x)
    cache = jnp.zeros((3, 4, 4))
    got = again(cache, x)
    assert cache.is_deleted()  # still donated
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-6)


def test_a_different_key_compiles_its_own_program(tmp_path):
    ExecutableCache(tmp_path).get_or_compile(("step", 1), _compile)
    with pytest.raises(AssertionError, match="compiled again"):
        ExecutableCache(tmp_path).get_or_compile(("step", 2), _refuse)


def test_a_damaged_file_is_compiled_again_and_replaced(tmp_path):
    ExecutableCache(tmp_path).get_or_compile("k", _compile)
    (saved,) = tmp_path.glob("*.exe")
    saved.write_bytes(b"not an executable")
    assert ExecutableCache(tmp_path).get_or_compile("k", _compile) is not None
    assert ExecutableCache(tmp_path).get_or_compile("k", _refuse) is not None


def test_without_a_directory_nothing_is_kept(tmp_path):
    calls = []
    cache = ExecutableCache(None)
    for _ in range(2):
        cache.get_or_compile("k", lambda: calls.append(1) or _compile())
    assert len(calls) == 2


def test_a_restarted_engine_loads_every_step_shape_and_generates_the_same(tiny_llama, tmp_path):
    config = EngineConfig(
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=64,
        num_blocks=40,
        compilation_cache_dir=tmp_path,
    )
    greedy = {"a": ([5, 9, 14, 2, 7], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))}
    first = LLMEngine(config, model=tiny_llama)
    saved = {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*.exe")}
    assert len(saved) == first.runner.num_compilations > 0
    expected = run_requests(first, greedy)["a"].outputs[0].token_ids
    restarted = LLMEngine(config, model=tiny_llama)
    assert {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*.exe")} == saved  # loaded, not rebuilt
    assert run_requests(restarted, greedy)["a"].outputs[0].token_ids == expected
