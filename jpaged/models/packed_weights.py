"""What the readers of quantized HF checkpoints share (models/compressed_tensors.py, fp8_checkpoint.py, awq.py,
gptq.py; models/checkpoint_quantization.py picks one): the reader's protocol, codes packed in int32 words, and
float8 matrices with a scale a block."""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

import numpy as np

from jpaged.models.grouped import GroupedMatrix, grouped_rows
from jpaged.models.params import GetTensor
from jpaged.models.quantized import QuantizedMatrix

# What a format gives for a matrix: kept quantized, or float32 [out, in] where it cannot be kept.
Matrix = GroupedMatrix | QuantizedMatrix | np.ndarray


class FormatReader(Protocol):
    def __call__(self, module: str, get: GetTensor, names: Collection[str]) -> Matrix | None:
        """The matrix of `module` (e.g. "model.layers.0.mlp.down_proj") in transformers' [out, in] orientation,
        or None where the module is not quantized in the checkpoint (its `.weight` is read as it is)."""
        ...


def unpack_words(words: np.ndarray, bits: int) -> np.ndarray:
    """int32 words [..., W] holding 32 / bits codes each, the first in the lowest bits -> uint8 codes
    [..., W * 32 / bits] (how compressed-tensors, AWQ and GPTQ pack 4- and 8-bit codes)."""
    if bits not in (4, 8):
        raise ValueError(f"only 4- and 8-bit packed codes are read, got num_bits={bits}")
    per_word = 32 // bits
    shifts = np.arange(per_word, dtype=np.uint32) * bits
    codes = (words.astype(np.uint32)[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return codes.reshape(*words.shape[:-1], -1).astype(np.uint8)


def rows_with_zeros(
    codes: np.ndarray, scale: np.ndarray, zero: np.ndarray | float, bits: int
) -> GroupedMatrix:
    """w = scale (codes - zero) of [out, in] codes with scale and zero [out, in / G] as a GroupedMatrix (its bias
    -scale zero)."""
    scale = np.asarray(scale, np.float32)
    return grouped_rows(codes, scale, -scale * np.float32(zero), bits)


def float8_rows(stored: np.ndarray, scale: np.ndarray) -> GroupedMatrix:
    """float8 [out, in] times a scale [out, in / G] (no bias) as a GroupedMatrix of float8 codes."""
    return grouped_rows(stored, scale, np.zeros_like(scale), 8, halves_if_exact=False)


def block_scaled(stored: np.ndarray, block_scale: np.ndarray) -> Matrix:
    """float8 [out, in] with a scale a block [ceil(out / bo), ceil(in / bi)] (DeepSeek's and Qwen's 128 x 128) as
    a GroupedMatrix of float8 codes grouped by `bi` inputs, each block's scale repeated over its outputs."""
    out, inputs = stored.shape
    rows, columns = block_scale.shape
    block_out, block_in = -(-out // rows), -(-inputs // columns)
    if inputs % block_in:
        raise ValueError(f"block scales of {block_in} inputs do not divide the {inputs} inputs of a matrix")
    scale = np.repeat(np.asarray(block_scale, np.float32), block_out, axis=0)[:out]
    return float8_rows(stored, scale)


def static_input_scale(module: str, get: GetTensor) -> np.ndarray:
    """A W8A8 module's calibrated activation scale (`input_scale`, one a tensor) as QuantizedMatrix holds it, [1, 1]
    float32."""
    return np.asarray(get(f"{module}.input_scale"), np.float32).reshape(1, 1)
