"""AutoGPTQ / GPTQModel checkpoints (`quant_method: gptq`), 4- or 8-bit: `qweight` int32 [in * bits / 32, out],
codes of neighbouring inputs packed a word, `qzeros` int32 [groups, out * bits / 32] packed along the outputs and
stored minus one in the original format (`checkpoint_format: gptq`; `gptq_v2` stores them as they are), `scales`
float16 [groups, out] and `g_idx` [in], each input's group. w = scale (q - zero).

With groups in input order (g_idx[k] = k // G, as without act-order) the matrix is kept as a GroupedMatrix. With
act-order (`desc_act`) an input's group is not k // G: such a matrix is dequantised to float32 at load, as the
grouped kernels read groups of consecutive inputs only."""

from __future__ import annotations

import logging
from collections.abc import Collection

import numpy as np

from jpaged.models.packed_weights import FormatReader, Matrix, rows_with_zeros, unpack_words
from jpaged.models.params import GetTensor

logger = logging.getLogger(__name__)


def reader(quantization: dict) -> FormatReader:
    bits = quantization.get("bits", 4)
    zero_stored_less_one = quantization.get("checkpoint_format", "gptq") == "gptq"
    warned = []

    def matrix_of(module: str, get: GetTensor, names: Collection[str]) -> Matrix | None:
        if f"{module}.qweight" not in names:
            return None
        codes = unpack_words(get(f"{module}.qweight").T, bits)  # [out, in]
        scale = np.asarray(get(f"{module}.scales"), np.float32).T  # [out, groups]
        zero = unpack_words(get(f"{module}.qzeros"), bits)[:, : codes.shape[0]].T.astype(np.float32)
        zero += np.float32(zero_stored_less_one)
        groups = _groups(get, names, module, codes.shape[1], scale.shape[1])
        if groups is None:
            return rows_with_zeros(codes, scale, zero, bits)
        if not warned:
            warned.append(module)
            logger.warning("GPTQ act-order (g_idx out of input order): its matrices are dequantised at load")
        return scale[:, groups] * (codes.astype(np.float32) - zero[:, groups])

    return matrix_of


def _groups(
    get: GetTensor, names: Collection[str], module: str, inputs: int, groups: int
) -> np.ndarray | None:
    """Each input's group where it is not input // G (act-order), else None."""
    if f"{module}.g_idx" not in names:
        return None
    g_idx = np.asarray(get(f"{module}.g_idx"), np.int64)
    return None if np.array_equal(g_idx, np.arange(inputs) // (inputs // groups)) else g_idx
