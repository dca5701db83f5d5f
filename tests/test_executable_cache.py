"""Compiled steps saved to disk come back as working executables, without compiling again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def test_on_a_machine_of_several_devices_a_saved_single_device_step_loads_and_runs(tmp_path):
    """Loaded, an executable was assigned every device of the client: on four (simulated) devices the second
    start's steps failed with "Expected args to execute_sharded_on_local_devices to have 4 shards"."""
    program = (
        "import sys\n"
        "from pathlib import Path\n"
        "import jax, jax.numpy as jnp\n"
        "from jpaged.runner.executable_cache import ExecutableCache\n"
        "assert jax.device_count() == 4\n"
        "x = jnp.arange(3.0)\n"
        "for _ in range(2):  # compiled and saved, then loaded from disk\n"
        "    step = ExecutableCache(Path(sys.argv[1])).get_or_compile('k', lambda: jax.jit(lambda x: 2 * x).lower(x).compile())\n"
        "    print(step(x).tolist())\n"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", program, str(tmp_path)],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:2] == ["[0.0, 2.0, 4.0]", "[0.0, 2.0, 4.0]"]
    assert list(tmp_path.glob("*.exe"))


def test_an_engine_on_several_devices_starts_again_from_its_saved_steps(tmp_path, tiny_llama_dir):
    """The second start is the one that loads the saved steps (the first compiles them), every one of them: the
    CPU kernels they call are registered before they load (a fresh process registers a kernel's targets only when a
    trace first requires it, and XLA refused the saved steps without them: "No FFI handler registered")."""
    program = (
        "import sys\n"
        "from jpaged import LLM, SamplingParams\n"
        "llm = LLM(sys.argv[1], max_model_len=64, max_num_seqs=8, max_num_batched_tokens=16, num_blocks=32,\n"
        "          compilation_cache_dir=sys.argv[2])\n"
        "greedy = SamplingParams(max_tokens=4, temperature=0)\n"
        "print(llm.generate([[1, 2, 3]], greedy, use_tqdm=False)[0].outputs[0].token_ids)\n"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    command = [sys.executable, "-c", program, str(tiny_llama_dir), str(tmp_path)]
    starts = [subprocess.run(command, env=env, capture_output=True, text=True, timeout=300) for _ in range(2)]
    for start in starts:
        assert start.returncode == 0, start.stderr[-2000:]
    assert starts[0].stdout == starts[1].stdout
    assert "ignoring the saved step program" not in starts[1].stderr, starts[1].stderr[-2000:]


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
    assert len(saved) == first.runner.num_compilations > 0  # steps and CoW copies
    expected = run_requests(first, greedy)["a"].outputs[0].token_ids
    restarted = LLMEngine(config, model=tiny_llama)
    assert {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*.exe")} == saved  # loaded, not rebuilt
    assert run_requests(restarted, greedy)["a"].outputs[0].token_ids == expected
