"""Ragged paged attention on the CPU through a small C++ kernel (cpu_paged_attention.cc), called as an XLA FFI
custom call. Same contract as reference.py.

Pallas has no CPU backend, and in XLA the attention of a decode step gathers and transposes every page before its
dots: ~1.9x the time of just reading the KV data (bench_decode_step). The kernel reads each page once, in place.

It is compiled on first use with the machine's C++ compiler (`CXX`, default `g++`) against the FFI headers jaxlib
ships, for this CPU (`-march=native`), into ~/.cache/jpaged/kernels (`JPAGED_KERNEL_CACHE` to move it). Where it
cannot be built, `available()` is False (a warning says why) and `auto` falls back to the XLA reference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jpaged.pallas.ragged_paged_attention import check_inputs, over_pages

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged_attention.cc")
_TARGET = "jpaged_paged_attention"
_UNINITIALIZED_TARGET = "jpaged_uninitialized"
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-ffp-contract=fast", "-fPIC", "-shared", "-std=c++17")
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _cpu_signature() -> str:
    """What `-march=native` depends on: a cached build is reused only on the same kind of CPU."""
    try:
        flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = ""
    return f"{platform.machine()} {flags}"


def _build(compiler: str) -> Path:
    """The shared library for this source, compiler and CPU, compiled once and kept."""
    key = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        compiler.encode(),
        " ".join(_FLAGS).encode(),
        jaxlib.__version__.encode(),
    ):
        key.update(part)
    key.update(_cpu_signature().encode())
    root = Path(os.environ.get("JPAGED_KERNEL_CACHE", Path.home() / ".cache" / "jpaged" / "kernels"))
    library = root / f"cpu_paged_attention-{key.hexdigest()[:16]}.so"
    if not library.exists():
        logger.info("compiling the CPU attention kernel into %s (once per machine)", root)
        root.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        command = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(partial)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        partial.replace(library)  # atomic: a concurrent process sees the whole library or none
    return library


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered with XLA (compiling it the first time on this machine)."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        logger.warning("no C++ compiler (%s) to build the CPU attention kernel", compiler)
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(compiler)))
        for target, symbol in (
            (_TARGET, library.JpagedPagedAttention),
            (_UNINITIALIZED_TARGET, library.JpagedUninitialized),
        ):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as err:
        logger.warning("could not build the CPU attention kernel: %s", err)
        return False
    return True


def uninitialized(shape: tuple[int, ...], dtype) -> jax.Array:
    """An array of `shape` that nothing has written: a KV pool for this kernel, which never reads a slot no sequence
    owns. Zero-filling the default 4 GiB pool took 3.5-5 s of a 2-core CPU's start-up; untouched, its pages are
    mapped in as blocks are first written."""
    if not available():
        raise RuntimeError("the CPU attention kernel could not be built (see the warning logged)")
    return jax.jit(jax.ffi.ffi_call(_UNINITIALIZED_TARGET, jax.ShapeDtypeStruct(shape, dtype)))()


def check_layout(head_dim: int, dtype) -> None:
    """The kernel works in float32 on eight-float vectors; raises ValueError where it cannot."""
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"the CPU kernel takes float32 or bfloat16, not {jnp.dtype(dtype)}")
    if head_dim % 8:
        raise ValueError(f"the CPU kernel needs a head_dim that is a multiple of 8, got {head_dim}")


def ragged_paged_attention_stacked(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    query_start: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    interpret: bool = False,
) -> jax.Array:
    """The kernel over one layer of a stacked cache `[L, N, B, Hk, D]` (contract in jpaged.pallas)."""
    del interpret  # same signature as the Pallas kernels
    check_inputs(
        q, k_cache, v_cache, kv_lens, block_tables, query_start, num_seqs, sliding_window, logits_soft_cap
    )
    check_layout(q.shape[-1], q.dtype)
    if k_cache.ndim != 5:
        raise ValueError(f"k_cache must be [L, N, B, Hk, D], got shape {k_cache.shape}")
    if not available():
        raise RuntimeError("the CPU attention kernel could not be built (see the warning logged)")
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(
        q,
        k_cache,
        v_cache,
        jnp.asarray(layer, jnp.int32).reshape(1),
        kv_lens,
        block_tables,
        query_start,
        num_seqs,
        sm_scale=np.float32(sm_scale),
        sliding_window=np.int32(sliding_window or 0),
        soft_cap=np.float32(logits_soft_cap or 0.0),
    )


ragged_paged_attention = over_pages(ragged_paged_attention_stacked)
