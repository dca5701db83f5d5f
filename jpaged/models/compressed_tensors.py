"""compressed-tensors checkpoints (llm-compressor's output; `quant_method: compressed-tensors`), kept quantized:

- `pack-quantized` (W4A16, W8A16): integer codes packed in int32 words along the inputs, a scale (and, asymmetric, a
  zero point packed along the outputs) per group, channel or tensor -> GroupedMatrix (w = scale (q - zero));
- `int-quantized` / `naive-quantized` int8: with integer input activations (W8A8) a QuantizedMatrix (int8 and a
  scale an output); weight-only, a GroupedMatrix of 8-bit codes;
- `float-quantized` FP8: W8A8 with a scale a tensor or channel -> QuantizedMatrix (float8); block scales (128 x 128)
  or weight-only -> a GroupedMatrix of float8 codes, dequantised where used.

A W8A8 matrix quantises its activations per token where `input_activations` are dynamic; where they are static
(calibrated: `dynamic: false`, llm-compressor's FP8 preset), by the module's `input_scale`, one a tensor, as vLLM
does; other static strategies and asymmetric ones (a zero point) are refused. Sparse (2:4) compression is refused.
"""

from __future__ import annotations

import re
from collections.abc import Collection

import numpy as np

from jpaged.models.packed_weights import (
    FormatReader,
    Matrix,
    block_scaled,
    float8_rows,
    rows_with_zeros,
    static_input_scale,
    unpack_words,
)
from jpaged.models.params import GetTensor
from jpaged.models.quantized import QuantizedMatrix

_READ_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")


def reader(quantization: dict) -> FormatReader:
    sparsity = quantization.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense"):
        raise ValueError(
            f"quantization_config.sparsity_config format {sparsity['format']!r} (sparse compression) is not supported"
        )
    groups = list((quantization.get("config_groups") or {}).values())  # none where only the KV cache is
    default_format = quantization.get("format")

    def matrix_of(module: str, get: GetTensor, names: Collection[str]) -> Matrix | None:
        if f"{module}.weight_packed" not in names and f"{module}.weight_scale" not in names:
            return None
        scheme = _scheme(groups, module)
        form = scheme.get("format") or default_format
        if form not in _READ_FORMATS:
            raise ValueError(
                f"compressed-tensors format {form!r} of {module} is not supported ({_READ_FORMATS})"
            )
        return _matrix(module, get, names, scheme["weights"], scheme.get("input_activations"))

    return matrix_of


def _scheme(groups: list[dict], module: str) -> dict:
    """The config group whose targets name `module` (a regex "re:..." or the module's name), else the one that
    targets every Linear layer (all of a decoder's matrices are)."""
    for group in groups:
        for target in group.get("targets", ()):
            if target.startswith("re:") and re.match(target[3:], module) or target == module:
                return group
    for group in groups:
        if "Linear" in group.get("targets", ()):
            return group
    raise ValueError(f"no quantization_config.config_groups entry targets {module}")


def _matrix(module: str, get: GetTensor, names, weights: dict, activations: dict | None) -> Matrix:
    bits, kind, strategy = weights["num_bits"], weights["type"], weights["strategy"]
    scale = np.asarray(get(f"{module}.weight_scale"), np.float32)
    if f"{module}.weight_g_idx" in names:
        raise ValueError(f"{module}: compressed-tensors activation ordering (weight_g_idx) is not supported")
    if f"{module}.weight_packed" in names:
        out, inputs = (int(d) for d in get(f"{module}.weight_shape"))
        codes = unpack_words(get(f"{module}.weight_packed"), bits)[:, :inputs]  # q + 2^(bits-1), unsigned
        offset = 1 << (bits - 1)
    else:
        stored = get(f"{module}.weight")
        out, inputs = stored.shape
        if kind == "float":
            return _float8(module, get, stored, scale, strategy, activations)
        if activations is not None and activations.get("type") == "int" and strategy in ("channel", "tensor"):
            scale = np.broadcast_to(scale, (out, 1)).copy()
            return QuantizedMatrix(stored.astype(np.int8), scale, _input_scale(module, get, activations))
        codes, offset = stored.view(np.int8), 0
    scale = _per_group(scale, out, inputs, strategy)
    zero = np.float32(offset)
    if not weights.get("symmetric", True):
        stored_zero = get(f"{module}.weight_zero_point")
        if f"{module}.weight_packed" in names:  # packed along the outputs, offset like the codes
            zero = unpack_words(stored_zero.T, bits)[:, :out].T.astype(np.float32)
        else:
            zero = np.asarray(stored_zero, np.float32) + offset
        zero = _per_group(zero, out, inputs, strategy)
    return rows_with_zeros(codes, scale, zero, bits)


def _per_group(values: np.ndarray, out: int, inputs: int, strategy: str) -> np.ndarray:
    """A tensor's, channel's or group's scale (or zero) as [out, groups]."""
    if strategy == "tensor":
        return np.broadcast_to(values.reshape(1, 1), (out, 1)).copy()
    if strategy in ("channel", "group"):
        return values.reshape(out, -1)
    raise ValueError(f"compressed-tensors integer weights with strategy {strategy!r} are not supported")


def _float8(
    module: str,
    get: GetTensor,
    stored: np.ndarray,
    scale: np.ndarray,
    strategy: str,
    activations: dict | None,
) -> Matrix:
    out, inputs = stored.shape
    if strategy == "block":
        return block_scaled(stored, scale)
    scale = _per_group(scale, out, inputs, strategy)
    if activations is not None and activations.get("type") == "float" and scale.shape[1] == 1:
        return QuantizedMatrix(stored, scale, _input_scale(module, get, activations))
    return float8_rows(stored, scale)


def _input_scale(module: str, get: GetTensor, activations: dict) -> np.ndarray | None:
    """A W8A8 module's static activation scale as [1, 1] (float32), or None where its activations are dynamic
    (quantised per token). compressed-tensors' `dynamic` defaults to false: a scheme that omits it is static."""
    dynamic = activations.get("dynamic", False)
    if dynamic is True:
        return None
    strategy = activations.get("strategy")
    if dynamic is not False or strategy != "tensor":
        raise ValueError(
            f"{module}: compressed-tensors input_activations strategy {strategy!r} with dynamic {dynamic!r} is not "
            "supported (static activation scales are read per tensor)"
        )
    if not activations.get("symmetric", True):
        raise ValueError(
            f"{module}: compressed-tensors input_activations symmetric false (a static zero point) is not supported"
        )
    return static_input_scale(module, get)
