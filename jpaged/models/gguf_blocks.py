"""GGUF's quantized blocks kept as they are: a tensor of a block type the kernels read becomes a GroupedMatrix
(codes, and a scale and a bias per block of a row) instead of float32. Each row of a GGUF matrix is an output of
the layer, its blocks running along the inputs, as GroupedMatrix groups them.

Kept: Q4_0 (w = d (q - 8)), Q4_1 (d q + m) and Q8_0 (d q), which keep their float16 d (and m) exactly; and the
K-quants Q4_K, Q5_K (d sc q - dmin m per 32 weights, 4- and 5-bit q) and Q6_K (d sc (q - 32) per 16 weights, 6-bit
q), whose 6- or 8-bit sub-block scales (and mins), multiplied out, need float32. The kernel reads 4-bit codes two a
byte and anything wider a byte each, so Q5_K's and Q6_K's 5- and 6-bit codes take a byte each (bits=8). Other types
(F32, F16, Q5_0, Q8_K...) are read dequantised, as before.
"""

from __future__ import annotations

import numpy as np

from jpaged.models.grouped import GroupedMatrix, grouped_rows

QK = 32  # weights a block of Q4_0, Q4_1, Q8_0 (and a sub-block of Q4_K and Q5_K)


def _halves(f16: np.ndarray) -> np.ndarray:
    return f16.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [rows, chunks, n] -> codes [rows, chunks * 2n]: a chunk's low nibbles are its first n codes."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(qs.shape[0], -1).astype(np.uint8)


def _q4_0(blocks: np.ndarray) -> GroupedMatrix:
    d = _halves(blocks[..., :2])[..., 0]
    return grouped_rows(_nibbles(blocks[..., 2:]), d, -8 * d, 4)


def _q4_1(blocks: np.ndarray) -> GroupedMatrix:
    d, m = _halves(blocks[..., :2])[..., 0], _halves(blocks[..., 2:4])[..., 0]
    return grouped_rows(_nibbles(blocks[..., 4:]), d, m, 4)


def _q8_0(blocks: np.ndarray) -> GroupedMatrix:
    d = _halves(blocks[..., :2])[..., 0]
    codes = blocks[..., 2:].view(np.int8).reshape(blocks.shape[0], -1)
    return grouped_rows(codes, d, np.zeros_like(d), 8)


def _q4_k(blocks: np.ndarray) -> GroupedMatrix:
    """Super-blocks of 256: float16 d and dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of codes
    (each 64 weights as 32 bytes, low nibbles first), w = d sc q - dmin m per sub-block of 32 (gguf.quants)."""
    rows, supers = blocks.shape[:2]
    scale, bias = _k_scales(blocks)
    qs = blocks[..., 16:].reshape(rows, supers * 4, 32)
    return grouped_rows(_nibbles(qs), scale, bias, 4, halves_if_exact=False)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's scale d sc and bias -dmin m per sub-block of 32, [rows, supers * 8] float32."""
    from gguf.quants import Q4_K

    rows, supers = blocks.shape[:2]
    d, dmin = _halves(blocks[..., :2]), _halves(blocks[..., 2:4])  # [rows, supers, 1]
    sc, mins = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
    scale = (d * sc.reshape(rows, supers, 8)).reshape(rows, -1)
    bias = (-dmin * mins.reshape(rows, supers, 8)).reshape(rows, -1)
    return scale, bias


def _bits_of(qh: np.ndarray, width: int) -> np.ndarray:
    """Bytes [rows, chunks, 32] -> fields [rows, chunks * (8 / width) * 32]: each byte's `width`-bit fields, low
    first, the field i of a chunk's bytes making its i-th run of 32."""
    shifts = np.arange(0, 8, width, dtype=np.uint8)[:, None]
    fields = (qh[..., None, :] >> shifts) & np.uint8((1 << width) - 1)
    return fields.reshape(qh.shape[0], -1)


def _q5_k(blocks: np.ndarray) -> GroupedMatrix:
    """Super-blocks of 256: float16 d and dmin, 12 bytes of eight 6-bit scales and mins (as Q4_K), 32 bytes of high
    bits (bit j of byte i: weight i of sub-block j), 128 bytes of low nibbles (as Q4_K's codes); w = d sc q - dmin m
    per sub-block of 32, q 0..31 (gguf.quants)."""
    rows, supers = blocks.shape[:2]
    scale, bias = _k_scales(blocks)
    low = _nibbles(blocks[..., 48:].reshape(rows, supers * 4, 32))
    high = _bits_of(blocks[..., 16:48], 1)
    return grouped_rows(low | (high << 4), scale, bias, 8, halves_if_exact=False)


def _q6_k(blocks: np.ndarray) -> GroupedMatrix:
    """Super-blocks of 256, two halves of 128 weights: 128 bytes of low nibbles (a half's 64 bytes, low nibbles its
    first 64 weights), 64 bytes of 2-bit high parts (a half's 32 bytes, the i-th 2 bits its i-th 32 weights), sixteen
    int8 scales, then float16 d; w = d scale (q - 32) per sub-block of 16, q 0..63 (gguf.quants)."""
    rows, supers = blocks.shape[:2]
    low = _nibbles(blocks[..., :128].reshape(rows, supers * 2, 64))
    high = _bits_of(blocks[..., 128:192].reshape(rows, supers * 2, 32), 2)
    codes = (low | (high << 4)).astype(np.int8) - np.int8(32)
    d = _halves(blocks[..., 208:210])  # [rows, supers, 1]
    scale = (d * blocks[..., 192:208].view(np.int8).astype(np.float32)).reshape(rows, -1)
    return grouped_rows(codes, scale, np.zeros_like(scale), 8, halves_if_exact=False)


# GGUF type name -> (bytes a block, decoder of [rows, blocks, bytes])
_BLOCK_TYPES = {
    "Q4_0": (18, _q4_0),
    "Q4_1": (20, _q4_1),
    "Q8_0": (34, _q8_0),
    "Q4_K": (144, _q4_k),
    "Q5_K": (176, _q5_k),
    "Q6_K": (210, _q6_k),
}
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
