"""Each CPU kernel builds on its own, when a program first calls it: the program compiles against a deferred
handler while the kernel builds, a call waits for the build, and a kernel that fails to build fails its calls with
a message (never a crash or a hang). A fresh process each (a kernel is built and registered once per process),
with an empty kernel cache and a compiler that holds the grouped kernel's build until the program has compiled."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the kernels are built with g++ here")

PROGRAM = """
import os
import numpy as np, jax, jax.numpy as jnp
from jpaged.pallas.cpu import grouped_matmul, library
from jpaged.pallas.cpu.matmul import ffi_product

rng = np.random.default_rng(0)
codes = rng.integers(0, 16, (1, 128, 32)).astype(np.uint8)
scale = (rng.random((1, 4, 32)) * 0.1).astype(np.float16)
panels = grouped_matmul.pack(codes, scale, np.zeros_like(scale), bits=4)
x = jnp.asarray(rng.standard_normal((3, 128)), jnp.float32)
KERNEL
compiled = jax.jit(product).lower(x, panels).compile()
print("built before the call:", kernel in library._OPENED)
open(os.environ["GATE"], "w").close()  # the held build goes on
try:
    y = np.asarray(compiled(x, panels))
except Exception as err:
    print("failed:", str(err).splitlines()[0])
else:
    w = codes[0].astype(np.float64) * np.repeat(scale[0].astype(np.float64), 32, 0)
    print("error:", float(np.abs(y - np.asarray(x, np.float64) @ w).max()))
"""
FORM = """
kernel = grouped_matmul.kernel(4, np.uint8, np.float16, np.float32)
product = lambda x, p: grouped_matmul.matmul(x, p, 32)
"""
BROKEN = """
kernel = library.Kernel("grouped_matmul.cc", {"jpaged_broken_form": "JpagedGroupedMatmul"}, ("-DJPAGED_GROUPED_BITS=4",))
def product(x, p):
    library.require(kernel)
    return ffi_product("jpaged_broken_form", x, p, 32, layer=0, rows=None)
"""


def _run(kernel: str, tmp_path) -> list[str]:
    compiler = tmp_path / "held-g++"
    compiler.write_text(
        "#!/bin/sh\n"
        'case "$*" in *grouped_matmul.cc*) while [ ! -e "$GATE" ]; do sleep 0.05; done;; esac\n'
        f'exec {shutil.which("g++")} "$@"\n'
    )
    compiler.chmod(0o755)
    env = {
        **os.environ,
        "CXX": str(compiler),
        "GATE": str(tmp_path / "gate"),
        "JPAGED_KERNEL_CACHE": str(tmp_path / "kernels"),
    }
    program = PROGRAM.replace("KERNEL", kernel)
    result = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


def test_a_program_compiles_while_its_kernel_builds_and_its_call_waits_for_the_build(tmp_path):
    built_before, error = _run(FORM, tmp_path)
    assert built_before == "built before the call: False"
    assert error.startswith("error:") and float(error.split()[1]) < 1e-3


def test_a_kernel_that_fails_to_build_fails_its_calls_with_a_message(tmp_path):
    built_before, failed = _run(BROKEN, tmp_path)
    assert built_before == "built before the call: False"
    assert failed.startswith("failed:") and "could not be built" in failed
