"""GGUF's quantized blocks kept as they are: a tensor of a block type the kernels read becomes a GroupedMatrix
(codes, and a scale and a bias per block of a row) instead of float32. Each row of a GGUF matrix is an output of
the layer, its blocks running along the inputs, as GroupedMatrix groups them.

Q4_0 (w = d (q - 8)), Q4_1 (d q + m) and Q8_0 (d q) keep their float16 d (and m) exactly; Q4_K's 6-bit sub-block
scales and mins, multiplied out per 32 weights, need float32. Other types (F32, F16, Q5_K, Q6_K...) are read
dequantised, as before.
"""

from __future__ import annotations

import numpy as np

from jpaged.models.grouped import GroupedMatrix

QK = 32  # weights a block of Q4_0, Q4_1, Q8_0 (and a sub-block of Q4_K)


def _halves(f16: np.ndarray) -> np.ndarray:
    return f16.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [rows, chunks, n] -> codes [rows, chunks * 2n]: a chunk's low nibbles are its first n codes."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(qs.shape[0], -1).astype(np.uint8)


def _grouped(codes: np.ndarray, scale: np.ndarray, bias: np.ndarray, bits: int) -> GroupedMatrix:
    """The [out, in] matrix of a GGUF's rows (codes [out, in], scale and bias [out, in / G]) stored grouped along
    `in`, so transposed; scale and bias as float16 where that holds them exactly, else float32."""
    scale, bias = scale.astype(np.float32), bias.astype(np.float32)
    halves = [a.astype(np.float16) for a in (scale, bias)]
    if all(np.array_equal(h.astype(np.float32), a) for h, a in zip(halves, (scale, bias), strict=True)):
        scale, bias = halves
    return GroupedMatrix(codes.T, scale.T, bias.T, bits, transposed=True)


def _q4_0(blocks: np.ndarray) -> GroupedMatrix:
    d = _halves(blocks[..., :2])[..., 0]
    return _grouped(_nibbles(blocks[..., 2:]), d, -8 * d, 4)


def _q4_1(blocks: np.ndarray) -> GroupedMatrix:
    d, m = _halves(blocks[..., :2])[..., 0], _halves(blocks[..., 2:4])[..., 0]
    return _grouped(_nibbles(blocks[..., 4:]), d, m, 4)


def _q8_0(blocks: np.ndarray) -> GroupedMatrix:
    d = _halves(blocks[..., :2])[..., 0]
    codes = blocks[..., 2:].view(np.int8).reshape(blocks.shape[0], -1)
    return _grouped(codes, d, np.zeros_like(d), 8)


def _q4_k(blocks: np.ndarray) -> GroupedMatrix:
    """Super-blocks of 256: float16 d and dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of codes
    (each 64 weights as 32 bytes, low nibbles first), w = d sc q - dmin m per sub-block of 32 (gguf.quants)."""
    from gguf.quants import Q4_K

    rows, supers = blocks.shape[:2]
    d, dmin = _halves(blocks[..., :2]), _halves(blocks[..., 2:4])  # [rows, supers, 1]
    sc, mins = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
    scale = (d * sc.reshape(rows, supers, 8)).reshape(rows, -1)
    bias = (-dmin * mins.reshape(rows, supers, 8)).reshape(rows, -1)
    qs = blocks[..., 16:].reshape(rows, supers * 4, 32)
    return _grouped(_nibbles(qs), scale, bias, 4)


# GGUF type name -> (bytes a block, decoder of [rows, blocks, bytes])
_BLOCK_TYPES = {"Q4_0": (18, _q4_0), "Q4_1": (20, _q4_1), "Q8_0": (34, _q8_0), "Q4_K": (144, _q4_k)}
KEPT_TYPES = tuple(_BLOCK_TYPES)


def grouped_tensor(tensor) -> GroupedMatrix | None:
    """A GGUF matrix (a gguf ReaderTensor) as a GroupedMatrix standing for transformers' [out, in] layout, or None
    where its type is not one kept as blocks."""
    kind = _BLOCK_TYPES.get(tensor.tensor_type.name)
    if kind is None or len(tensor.shape) != 2:
        return None
    block_bytes, decode = kind
    data = np.asarray(tensor.data, np.uint8)
    rows = int(tensor.shape[1])
    return decode(data.reshape(rows, -1, block_bytes))
