"""The C++ CPU kernels, each a shared library of its own (a `Kernel`: paged_attention.cc, matmul.cc, int8_matmul.cc,
expert_matmul.cc, and grouped_matmul.cc once per form of weights), built on first use and registered with XLA as FFI
targets.

Each is compiled with the machine's C++ compiler (`CXX`, default `g++`) against the FFI headers jaxlib ships, for
this CPU (`-march=native`), into ~/.cache/jpaged/kernels (`JPAGED_KERNEL_CACHE` to move it). Built apart, a model
waits only for the kernels it multiplies with (the embedded default model for none of the dense, int8 and expert
ones, and for two of the grouped kernel's eighteen forms), and they build on cores of their own: an engine starts
the attention's first thing (`build_in_background`) and loads its weights meanwhile; a product's kernel starts
building when a program first calls it (`require`), which compiles meanwhile. Where the compiler cannot build
`COMMON`, the small library every model needs first, `compiles()` is False (a warning says why) and callers fall
back to XLA.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
HEADERS = (_HERE / "kernel.h", _HERE / "panels.h")


@dataclass(frozen=True)
class Kernel:
    """One of the kernels' shared libraries: its source, the FFI targets it registers ({target: exported handler
    symbol}) and the preprocessor definitions it is built with (a form of the grouped kernel)."""

    source: str
    targets: Mapping[str, str] = field(default_factory=dict, hash=False)
    defines: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return "-".join((Path(self.source).stem, *(d.split("=")[-1] for d in self.defines))).replace(" ", "")


# What every model needs (common.cc): which bfloat16 instructions the products multiply with (bfloat16_arithmetic)
# and an array nothing writes (the KV pool's); compiled in a second or two, and the probe that the compiler builds
# the kernels at all.
UNINITIALIZED = "jpaged_uninitialized"
COMMON = Kernel("common.cc", {UNINITIALIZED: "JpagedUninitialized"})
# What the kernels compute on (kernel.h converts bfloat16 to and from float32; float16 is not handled).
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# The C type a kernel's form is built with for each dtype (bfloat16 as its 16 bits; float16 scales as _Float16).
C_TYPES = {
    "uint8": "uint8_t",
    "int8": "int8_t",
    "float16": "_Float16",
    "float32": "float",
    "bfloat16": "uint16_t",
}
# -ffast-math's parts, not the flag itself: linking a library with -ffast-math (or -funsafe-math-optimizations) adds
# crtfastmath.o, whose constructor turns on flush-to-zero for the process that loads it, so no Python code in the
# server could represent a subnormal float again (hypothesis refuses to generate floats then).
_FAST_MATH = (
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-freciprocal-math",
    "-fno-signed-zeros",
    "-ffinite-math-only",
    "-fcx-limited-range",
)
_FLAGS = ("-O3", "-march=native", *_FAST_MATH, "-ffp-contract=fast", "-fPIC", "-std=c++17")
# glibc's vector math library (libmvec) on x86-64: attention's exps eight at a time (paged_attention.cc); its
# define is a compiler flag, the library a linker one.
_LIBMVEC = platform.machine() == "x86_64" and platform.libc_ver()[0] == "glibc"
_VECTOR_MATH_DEFINE, _VECTOR_MATH_LIBRARY = (("-DJPAGED_LIBMVEC",), ("-lmvec",)) if _LIBMVEC else ((), ())


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))


def _cpu_signature() -> str:
    """What `-march=native` depends on: a cached build is reused only on the same kind of CPU."""
    return f"{platform.machine()} {' '.join(sorted(cpu_flags()))}"


def _build(kernel: Kernel, compiler: str) -> Path:
    """`kernel`'s shared library for its source, the headers, this compiler and CPU, compiled once and kept."""
    source = _HERE / kernel.source
    key = hashlib.sha256()
    for part in (
        *(path.read_bytes() for path in (source, *HEADERS)),
        compiler.encode(),
        " ".join(_FLAGS + kernel.defines + _VECTOR_MATH_DEFINE + _VECTOR_MATH_LIBRARY).encode(),
        jaxlib.__version__.encode(),
        _cpu_signature().encode(),
    ):
        key.update(part)
    root = Path(os.environ.get("JPAGED_KERNEL_CACHE", Path.home() / ".cache" / "jpaged" / "kernels"))
    library = root / f"jpaged-{kernel.name}-{key.hexdigest()[:16]}.so"
    if not library.exists():
        logger.info("compiling the CPU kernel %s into %s (once per machine)", kernel.name, root)
        start = time.perf_counter()
        root.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        compile_sources([source], partial, compiler, extra=kernel.defines)
        partial.replace(library)  # atomic: a concurrent process sees the whole library or none
        logger.info("CPU kernel %s compiled in %.1f s", kernel.name, time.perf_counter() - start)
    return library


def compile_sources(
    sources, output: Path, compiler: str = "g++", march: str = "native", extra: tuple[str, ...] = ()
) -> None:
    """Compiles C++ `sources` into the shared library `output` with the kernels' flags and headers, each source on
    a core of its own, then links them (also what scripts/ab_cpu_kernels.py builds its variants with, and the tests
    their builds for other CPU levels, `march`, or with `extra` flags: the AMX model's define and include folder);
    raises RuntimeError with the compiler's message."""
    flags = [
        *(f"-march={march}" if flag == "-march=native" else flag for flag in _FLAGS),
        *extra,
        f"-I{jax.ffi.include_dir()}",
        f"-I{_HERE}",
        *_VECTOR_MATH_DEFINE,
    ]
    with tempfile.TemporaryDirectory() as objects, ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        compiled = [str(Path(objects) / f"{i}.o") for i in range(len(sources))]
        commands = [
            [compiler, *flags, "-c", str(src), "-o", obj] for src, obj in zip(sources, compiled, strict=True)
        ]
        for result in pool.map(_run, commands):
            _check(result)
        # The vector math library after the objects: the linker keeps only libraries that something before needs.
        _check(_run([compiler, "-shared", *compiled, "-o", str(output), *_VECTOR_MATH_LIBRARY]))


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True)


def _check(result: subprocess.CompletedProcess) -> None:
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(result.args)} failed:\n{result.stderr[-2000:]}")


def register(library: Path, targets: dict[str, str]) -> ctypes.CDLL:
    """Loads the built `library` and registers its handlers with XLA's CPU backend ({FFI target: symbol})."""
    handle = ctypes.cdll.LoadLibrary(str(library))
    for target, symbol in targets.items():
        jax.ffi.register_ffi_target(target, _handler(handle, symbol), platform="cpu")
    return handle


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


_LOCKS: dict[Kernel, threading.Lock] = {}  # a kernel's build
_LOCKS_LOCK = threading.Lock()
_OPENED: dict[Kernel, ctypes.CDLL | None] = {}
# A kernel whose targets are registered: to deferred handlers (their slots), or to its own (None).
_REGISTERED: dict[Kernel, list[int] | None] = {}
_REGISTERING = threading.Lock()


def _opened(kernel: Kernel) -> ctypes.CDLL | None:
    """`kernel`'s library built (the first time on this machine) and opened, or None where it cannot be built (a
    warning says why); one build of a kernel at a time, other kernels' beside it."""
    with _LOCKS_LOCK:
        lock = _LOCKS.setdefault(kernel, threading.Lock())
    with lock:
        if kernel not in _OPENED:
            _OPENED[kernel] = _built(kernel)
        return _OPENED[kernel]


def _built(kernel: Kernel) -> ctypes.CDLL | None:
    compiler = _compiler()
    if shutil.which(compiler) is None:
        logger.warning("no C++ compiler (%s) to build the CPU kernels", compiler)
        return None
    try:
        return ctypes.cdll.LoadLibrary(str(_build(kernel, compiler)))
    except (OSError, RuntimeError) as err:
        logger.warning("could not build the CPU kernel %s: %s", kernel.name, err)
        return None


def _handler(library: ctypes.CDLL, symbol: str):
    return jax.ffi.pycapsule(getattr(library, symbol))


def load(kernel: Kernel) -> ctypes.CDLL | None:
    """`kernel` built and its handlers behind its FFI targets, or None where it cannot be built."""
    library = _opened(kernel)
    with _REGISTERING:
        if kernel not in _REGISTERED and library is not None:
            for target, symbol in kernel.targets.items():
                jax.ffi.register_ffi_target(target, _handler(library, symbol), platform="cpu")
            _REGISTERED[kernel] = None
        elif _REGISTERED.get(kernel):  # deferred: the slots now forward to the handlers
            point = _opened(COMMON).JpagedSetDeferred
            for slot, symbol in zip(_REGISTERED[kernel], kernel.targets.values(), strict=True):
                point(
                    slot, None if library is None else ctypes.cast(getattr(library, symbol), ctypes.c_void_p)
                )
            _REGISTERED[kernel] = None
    return library


_RECORDING = threading.local()  # the kernels this thread's `recording` blocks have required


@contextlib.contextmanager
def recording() -> Iterator[set[Kernel]]:
    """The kernels `require`d on this thread while the block runs: what a program traced in it calls, which a
    saved executable needs registered again before it loads (runner/executable_cache.py)."""
    outer = getattr(_RECORDING, "kernels", None)
    _RECORDING.kernels = kernels = set()
    try:
        yield kernels
    finally:
        _RECORDING.kernels = outer
        if outer is not None:
            outer |= kernels


def require(kernel: Kernel) -> None:
    """`kernel`'s FFI targets registered with XLA, so that programs calling them compile now; where its library is
    still to be built, they are registered to deferred handlers (common.cc) and it builds on a thread: a call waits
    for the build, and fails with a message if the build does. Raises RuntimeError where the kernels cannot be
    built at all (`compiles()`)."""
    if getattr(_RECORDING, "kernels", None) is not None:
        _RECORDING.kernels.add(kernel)
    if not compiles():
        raise RuntimeError(f"the CPU kernel {kernel.name} could not be built (see the warning logged)")
    with _REGISTERING:
        if kernel in _REGISTERED:
            return
        slots = _deferred_slots(len(kernel.targets)) if kernel not in _OPENED else None
        if slots is not None:
            common = _opened(COMMON)
            for slot, target in zip(slots, kernel.targets, strict=True):
                handler = jax.ffi.pycapsule(common.JpagedDeferredHandler(slot))
                jax.ffi.register_ffi_target(target, handler, platform="cpu")
            _REGISTERED[kernel] = slots
    if slots is None:  # built already, or no slot left: registered as it is, waiting for it here
        if load(kernel) is None:
            raise RuntimeError(f"the CPU kernel {kernel.name} could not be built (see the warning logged)")
    else:
        build_in_background(kernel)


_next_slot = 0


def _deferred_slots(count: int) -> list[int] | None:
    """`count` unused deferred handlers' slots (under _REGISTERING), or None where too few are left."""
    global _next_slot
    common = _opened(COMMON)
    if _next_slot + count > common.JpagedDeferredSlots():
        return None
    common.JpagedDeferredHandler.restype = ctypes.c_void_p
    common.JpagedSetDeferred.argtypes = (ctypes.c_int, ctypes.c_void_p)
    _next_slot += count
    return list(range(_next_slot - count, _next_slot))


def build_in_background(*kernels: Kernel) -> None:
    """Start building (or loading) `kernels`, each on a thread of its own; a first use waits for its build."""
    for kernel in kernels:
        threading.Thread(
            target=load, args=(kernel,), name=f"jpaged-kernel-{kernel.name}", daemon=True
        ).start()


def available(kernel: Kernel) -> bool:
    """Whether `kernel` is built and registered with XLA (building it if need be)."""
    return load(kernel) is not None


def compiles() -> bool:
    """Whether this machine builds the CPU kernels (its compiler builds `COMMON`): what callers choose a kernel
    by, without waiting for the kernel's own build."""
    return available(COMMON)


def bfloat16_dot_products() -> str | None:
    """The bfloat16 dot-product instructions the CPU lists that a `-march=native` build of the kernels multiplies
    with (`amx_bf16`, `avx512_bf16`), or None (none listed, or no compiler to build the kernels): what
    `bfloat16_arithmetic` will say once the kernels are built (AMX where Linux grants it), known without them."""
    if shutil.which(_compiler()) is None:
        return None
    flags = cpu_flags()
    if {"amx_tile", "amx_bf16"} <= flags:
        return "amx_bf16"
    return "avx512_bf16" if "avx512_bf16" in flags else None


def bfloat16_arithmetic() -> str | None:
    """The bfloat16 dot-product instructions the matmul kernel multiplies with on this CPU (`amx_bf16` where the
    tiles are built and Linux grants them, else `avx512_bf16`), or None where it widens bfloat16 to float32 (or the
    kernels cannot be built)."""
    library = load(COMMON)
    if library is None:
        return None
    query = library.JpagedBfloat16Arithmetic
    query.restype = ctypes.c_char_p
    return query().decode() or None


def pairs_bfloat16_panels() -> bool:
    """Whether the matmul kernels built here read bfloat16 panels paired (AVX-512-BF16 and AMX builds: rows k and
    k + 1 of a column side by side, as vdpbf16ps and the tiles take them); False where the kernels cannot be built."""
    library = load(COMMON)
    if library is None:
        return False
    query = library.JpagedPairsBfloat16Panels
    query.restype = ctypes.c_bool
    return bool(query())
