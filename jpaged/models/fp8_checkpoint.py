"""FP8 checkpoints as Qwen3-FP8 and DeepSeek-V3 publish them (`quant_method: fp8`, transformers'
FineGrainedFP8Config): each matrix float8 e4m3 with `weight_scale_inv`, a scale a block of `weight_block_size`
(128 x 128), kept as a GroupedMatrix of float8 codes (packed_weights.block_scaled); without block sizes, one
scale a matrix (`weight_scale_inv`, or AutoFP8's `weight_scale`, which vLLM's fp8 reads the same), a W8A8
QuantizedMatrix, with its `input_scale` applied where `activation_scheme` is static."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from jpaged.models.packed_weights import FormatReader, Matrix, block_scaled, static_input_scale
from jpaged.models.params import GetTensor
from jpaged.models.quantized import QuantizedMatrix


def reader(quantization: dict) -> FormatReader:
    if quantization.get("fmt", "e4m3") != "e4m3":
        raise ValueError(
            f"quantization_config.fmt {quantization['fmt']!r}: only e4m3 FP8 checkpoints are read"
        )
    blocks = quantization.get("weight_block_size")
    activations = quantization.get("activation_scheme", "dynamic")
    if activations not in ("static", "dynamic"):
        raise ValueError(
            f"quantization_config.activation_scheme {activations!r} is not 'static' or 'dynamic'"
        )
    if activations == "static" and blocks:
        raise ValueError(
            "quantization_config.activation_scheme 'static' with weight_block_size is not supported"
        )

    def matrix_of(module: str, get: GetTensor, names: Collection[str]) -> Matrix | None:
        scale_name = next(
            (f"{module}.{n}" for n in ("weight_scale_inv", "weight_scale") if f"{module}.{n}" in names), None
        )
        if scale_name is None:
            return None
        stored, scale = get(f"{module}.weight"), np.asarray(get(scale_name), np.float32)
        if blocks:
            return block_scaled(stored, scale.reshape(-(-stored.shape[0] // blocks[0]), -1))
        per_row = np.broadcast_to(scale.reshape(1, 1), (stored.shape[0], 1)).copy()
        if activations == "dynamic":
            return QuantizedMatrix(stored, per_row)
        return QuantizedMatrix(stored, per_row, static_input_scale(module, get))

    return matrix_of
