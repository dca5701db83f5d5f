"""FP8 checkpoints as Qwen3-FP8 and DeepSeek-V3 publish them (`quant_method: fp8`, transformers'
FineGrainedFP8Config): each matrix float8 e4m3 with `weight_scale_inv`, a scale a block of `weight_block_size`
(128 x 128), kept as a GroupedMatrix of float8 codes (packed_weights.block_scaled); without block sizes, one
scale a matrix, a W8A8 QuantizedMatrix."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from jpaged.models.packed_weights import FormatReader, Matrix, block_scaled
from jpaged.models.params import GetTensor
from jpaged.models.quantized import QuantizedMatrix


def reader(quantization: dict) -> FormatReader:
    if quantization.get("fmt", "e4m3") != "e4m3":
        raise ValueError(
            f"quantization_config.fmt {quantization['fmt']!r}: only e4m3 FP8 checkpoints are read"
        )
    blocks = quantization.get("weight_block_size")

    def matrix_of(module: str, get: GetTensor, names: Collection[str]) -> Matrix | None:
        if f"{module}.weight_scale_inv" not in names:
            return None
        stored, scale = get(f"{module}.weight"), np.asarray(get(f"{module}.weight_scale_inv"), np.float32)
        if blocks:
            return block_scaled(stored, scale.reshape(-(-stored.shape[0] // blocks[0]), -1))
        return QuantizedMatrix(stored, np.broadcast_to(scale.reshape(1, 1), (stored.shape[0], 1)).copy())

    return matrix_of
