"""gpt-oss's MXFP4 experts (`quant_method: mxfp4`): each expert matrix stored as `{name}_blocks` uint8 [E, N, K/32,
16], two 4-bit e2m1 codes a byte (the low nibble first), and `{name}_scales` uint8 [E, N, K/32], a power of two
(exponent + 127) a block of 32 inputs. Read dequantised to float32 [E, K, N], as transformers' own loading does
(integrations/mxfp4.py, convert_moe_packed_tensors), until the experts are kept packed."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from jpaged.models.params import GetTensor

E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)


def reader(quantization: dict):
    def matrix_of(module: str, get: GetTensor, names: Collection[str]) -> np.ndarray | None:
        if f"{module}_blocks" not in names:
            return None
        return dequantize(np.asarray(get(f"{module}_blocks")), np.asarray(get(f"{module}_scales")))

    return matrix_of


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [..., K, N] of blocks [..., N, K/32, 16] and their scales [..., N, K/32]."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match")
    values = np.empty((*blocks.shape[:-1], 2 * blocks.shape[-1]), np.float32)
    values[..., 0::2] = E2M1[blocks & 0x0F]
    values[..., 1::2] = E2M1[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return np.swapaxes(values.reshape(*blocks.shape[:-2], -1), -1, -2)
