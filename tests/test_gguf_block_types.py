"""Each GGUF block type kept as its blocks (gguf_blocks.KEPT_TYPES) is read as a GroupedMatrix that dequantises
exactly as the gguf library does, in the form the module documents (bits, codes' and scales' dtypes, group size);
a type not kept is left to be read dequantised."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from jpaged.models.gguf_blocks import KEPT_TYPES, grouped_tensor
from jpaged.models.grouped import GroupedMatrix, host_dequantized

OUT, IN = 48, 512  # IN a multiple of the K-quants' 256
# The form each kept type is documented to take: bits, codes' dtype, scales' dtype, group size.
FORMS = {
    "Q4_0": (4, np.uint8, np.float16, 32),
    "Q4_1": (4, np.uint8, np.float16, 32),
    "Q8_0": (8, np.int8, np.float16, 32),
    "Q4_K": (4, np.uint8, np.float32, 32),
    "Q5_K": (8, np.uint8, np.float32, 32),
    "Q6_K": (8, np.int8, np.float32, 16),
}
# Where a block holds its float16 d (and dmin), for the types gguf cannot quantize.
HALF_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


@dataclass(frozen=True)
class Tensor:
    """What grouped_tensor reads of a gguf ReaderTensor."""

    tensor_type: GGMLQuantizationType
    shape: tuple[int, int]  # GGUF's order: [in, out]
    data: np.ndarray  # uint8 [out, bytes a row]


def _random_blocks(qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks of random bytes: their float16 d (and dmin) replaced by finite values."""
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (OUT, IN // block_size, block_bytes), dtype=np.uint8)
    for offset in HALF_OFFSETS[qtype.name]:
        halves = (rng.standard_normal((OUT, IN // block_size)) * 0.01).astype(np.float16)
        blocks[..., offset : offset + 2] = halves.view(np.uint8).reshape(OUT, -1, 2)
    return blocks.reshape(OUT, -1)


def _tensor(name: str, seed: int = 0) -> Tensor:
    """A [OUT, IN] matrix of fresh random data of type `name`, quantized by gguf where it can, else random blocks."""
    qtype = GGMLQuantizationType[name]
    rng = np.random.default_rng(seed)
    try:
        data = quantize(rng.standard_normal((OUT, IN)).astype(np.float32), qtype)
    except NotImplementedError:
        data = _random_blocks(qtype, rng)
    return Tensor(qtype, (IN, OUT), np.asarray(data).view(np.uint8))


def _gguf_dequantized(tensor: Tensor) -> np.ndarray:
    return dequantize(tensor.data, tensor.tensor_type).reshape(OUT, IN)


@pytest.mark.parametrize("name", KEPT_TYPES)
def test_each_kept_block_type_dequantises_exactly_as_gguf_does(name):
    for seed in range(3):
        tensor = _tensor(name, seed)
        matrix = grouped_tensor(tensor)
        assert isinstance(matrix, GroupedMatrix) and matrix.transposed
        assert matrix.shape == (OUT, IN)
        np.testing.assert_array_equal(host_dequantized(matrix), _gguf_dequantized(tensor))


@pytest.mark.parametrize("name", KEPT_TYPES)
def test_each_kept_block_type_takes_its_documented_bits_dtypes_and_group_size(name):
    matrix = grouped_tensor(_tensor(name))
    bits, codes_dtype, scale_dtype, group_size = FORMS[name]
    assert matrix.bits == bits
    assert matrix.codes.dtype == codes_dtype
    assert matrix.scale.dtype == scale_dtype and matrix.bias.dtype == scale_dtype
    assert matrix.group_size == group_size
    assert matrix.codes.shape == (IN, OUT) and matrix.scale.shape == (IN // group_size, OUT)


def test_every_kept_block_type_has_a_documented_form():
    assert set(KEPT_TYPES) == set(FORMS)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_legacy_block_types_keep_their_float16_scale_and_bias_exactly(name):
    tensor = _tensor(name)
    matrix = grouped_tensor(tensor)
    assert matrix.scale.dtype == np.float16 and matrix.bias.dtype == np.float16
    d = tensor.data.reshape(OUT, IN // 32, -1)[..., :2].copy().view(np.float16)[..., 0]
    np.testing.assert_array_equal(matrix.scale, d.T)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
def test_four_bit_block_types_hold_four_bit_codes(name):
    matrix = grouped_tensor(_tensor(name))
    assert matrix.bits == 4 and int(matrix.codes.max()) <= 15


@pytest.mark.parametrize(("name", "low", "high"), [("Q5_K", 0, 31), ("Q6_K", -32, 31)])
def test_five_and_six_bit_codes_take_a_byte_each_in_their_range(name, low, high):
    matrix = grouped_tensor(_tensor(name))
    assert matrix.bits == 8
    assert int(matrix.codes.min()) == low and int(matrix.codes.max()) == high


@pytest.mark.parametrize("name", ["F16", "Q5_0"])
def test_a_type_not_kept_as_blocks_gives_none(name):
    assert name not in KEPT_TYPES
    qtype = GGMLQuantizationType[name]
    data = quantize(np.random.default_rng(0).standard_normal((OUT, IN)).astype(np.float32), qtype)
    assert grouped_tensor(Tensor(qtype, (IN, OUT), np.asarray(data).view(np.uint8))) is None
