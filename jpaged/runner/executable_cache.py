"""Compiled step programs kept on disk, so a restart skips tracing, lowering and compiling them.

JAX's persistent compilation cache skips XLA's compile, but every step shape is still traced and lowered first,
which was most of a warm start (README, bench_startup.py). Here the compiled executable
itself is serialised (jax.experimental.serialize_executable) under a key that covers what the program depends
on: the jpaged sources (C++ kernels included), the jax and jaxlib versions, the devices, XLA_FLAGS and the jax options that change
lowering, and the step's own inputs (every argument's shape and dtype, the model config, static arguments). Beside
the executable, the CPU kernels its trace required: their FFI targets must be registered again before it loads
(their libraries build on first use), or XLA refuses it. An entry that fails to load is compiled again and
replaced.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jaxlib

from jpaged.pallas.cpu import library as cpu_kernels

logger = logging.getLogger(__name__)

_PACKAGE = Path(__file__).resolve().parents[1]  # all of jpaged


def environment_fingerprint() -> str:
    """What every compiled step depends on beyond its own inputs."""
    digest = hashlib.sha256()
    for path in sorted(path for pattern in ("*.py", "*.cc", "*.h") for path in _PACKAGE.rglob(pattern)):
        digest.update(str(path.relative_to(_PACKAGE)).encode())
        digest.update(path.read_bytes())
    devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
    options = (
        jax.__version__,
        jaxlib.__version__,
        devices,
        os.environ.get("XLA_FLAGS", ""),
        jax.config.jax_enable_x64,
        jax.config.jax_default_matmul_precision,
    )
    digest.update(repr(options).encode())
    return digest.hexdigest()


class ExecutableCache:
    """Serialised executables in `directory`, one file per key; `None` directory: nothing is kept."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._fingerprint = environment_fingerprint() if directory is not None else ""

    def get_or_compile(self, key: Any, compile_fn: Callable[[], Any]) -> Any:
        """The executable saved under `key` (any repr-able value), else `compile_fn()`, saved for next time."""
        if self.directory is None:
            return compile_fn()
        path = self.directory / f"{hashlib.sha256((self._fingerprint + repr(key)).encode()).hexdigest()}.exe"
        if path.exists():
            try:
                return _deserialize(path.read_bytes())
            except Exception as err:  # a truncated or foreign file: compile again, replace it
                logger.warning("ignoring the saved step program %s: %s", path.name, err)
        with cpu_kernels.recording() as kernels:
            compiled = compile_fn()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_bytes(_serialize(compiled, kernels))
            partial.replace(path)  # atomic: a concurrent reader sees the whole file or none
        except (OSError, ValueError, TypeError) as err:
            logger.warning("could not save the step program: %s", err)
        return compiled


def step_cache(directory: str | None) -> ExecutableCache:
    """Where compiled steps persist across restarts (`directory`, default ~/.cache/jpaged/xla).

    On CPU, jpaged's executable cache: whole executables, so a restart skips tracing and lowering as well. It
    replaces JAX's persistent compilation cache there, because an
    executable that came from that cache serialises again without some of its kernels (jaxlib 0.10: "Function
    wrapped_iota not found" when run). Elsewhere, or when the user chose JAX's cache directory, JAX's cache.
    """
    root = Path(directory) if directory else Path.home() / ".cache" / "jpaged" / "xla"
    if jax.config.jax_compilation_cache_dir:
        return ExecutableCache(None)  # the user (or JAX_COMPILATION_CACHE_DIR) chose JAX's cache
    if jax.default_backend() == "cpu":
        # A multi-process program's executable is one process's part of it: compiled afresh each start.
        return ExecutableCache(root / "executables" if jax.process_count() == 1 else None)
    jax.config.update("jax_compilation_cache_dir", str(root))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return ExecutableCache(None)


def _serialize(compiled, kernels: set[cpu_kernels.Kernel]) -> bytes:
    """The executable, the ids of the devices it runs on (loading would otherwise assign it every device of the
    client, which a single-device program on a multi-device machine cannot run on) and the CPU kernels it calls."""
    from jax.experimental import serialize_executable

    device_ids = [device.id for device in compiled.runtime_executable().local_devices()]
    return pickle.dumps((serialize_executable.serialize(compiled), device_ids, kernels))


def _deserialize(data: bytes):
    """The saved executable loaded, once the kernels it calls are registered."""
    from jax.experimental import serialize_executable

    serialized, device_ids, kernels = pickle.loads(data)
    for kernel in kernels:
        cpu_kernels.require(kernel)
    by_id = {device.id: device for device in jax.devices()}
    devices = [by_id[i] for i in device_ids]
    return serialize_executable.deserialize_and_load(*serialized, execution_devices=devices)
