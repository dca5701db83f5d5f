"""AutoAWQ checkpoints in the GEMM layout (`quant_method: awq`, `version: gemm`), kept as GroupedMatrix: `qweight`
int32 [in, out / 8], eight 4-bit codes of neighbouring outputs a word in AWQ's interleaved order, `qzeros` packed the
same way [in / G, out / 8], `scales` float16 [in / G, out]; w = scale (q - zero)."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from jpaged.models.packed_weights import FormatReader, Matrix, rows_with_zeros, unpack_words
from jpaged.models.params import GetTensor

_NATURAL_ORDER = np.array(
    [0, 4, 1, 5, 2, 6, 3, 7]
)  # the code of output j of a word is its nibble _NATURAL_ORDER[j]


def reader(quantization: dict) -> FormatReader:
    bits = quantization.get("bits", quantization.get("w_bit", 4))
    version = str(quantization.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise ValueError(
            f"AWQ checkpoints are read in the 4-bit GEMM layout; this one has bits={bits}, version={version!r}"
        )
    zero_point = quantization.get("zero_point", True)

    def matrix_of(module: str, get: GetTensor, names: Collection[str]) -> Matrix | None:
        if f"{module}.qweight" not in names:
            return None
        codes = _outputs_in_order(get(f"{module}.qweight"))  # [in, out]
        scale = np.asarray(get(f"{module}.scales"), np.float32)  # [in / G, out]
        zero = _outputs_in_order(get(f"{module}.qzeros")).astype(np.float32) if zero_point else np.float32(8)
        return rows_with_zeros(codes.T, scale.T, np.transpose(zero), bits)

    return matrix_of


def _outputs_in_order(words: np.ndarray) -> np.ndarray:
    codes = unpack_words(words, 4)
    return codes.reshape(*codes.shape[:-1], -1, 8)[..., _NATURAL_ORDER].reshape(codes.shape)
