"""Exporting a function for a GPU or TPU on a machine without one (tests' helper; imports only jax)."""

from __future__ import annotations

import contextlib

import jax

TRITON_CALL = "__gpu$xla.gpu.triton"  # Pallas-Triton's custom call: no export compatibility guarantee

# The GPU the cuda lowering targets: jax >= 0.11 lowers Pallas-Triton for a named GPU (its compute capability),
# and a machine without one names it through an abstract device (jax 0.10 takes the same and needs none).
TARGET_GPU = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")


def abstract_gpu(device_kind: str) -> jax.sharding.AbstractDevice:
    """A GPU by name (an "NVIDIA H100 80GB HBM3", an "NVIDIA B200"), for an export on a machine without one."""
    return jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=132, platform="cuda")


def export_text(fn, platform: str, args, gpu: jax.sharding.AbstractDevice = TARGET_GPU) -> str:
    """The StableHLO text of `fn` exported for `platform` ("cuda" or "tpu") on these abstract args (for cuda, on
    the abstract `gpu`)."""
    disabled, target = [], contextlib.nullcontext()
    if platform == "cuda":
        disabled = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
        target = jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu))
    with target:
        exported = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=disabled)(*args)
    return exported.mlir_module()
