"""HF checkpoints shipped quantized (a `quantization_config` in config.json): each layer matrix read kept as it is
stored, as the GroupedMatrix (integer or float8 codes, a scale and a bias a group of inputs) or QuantizedMatrix
(W8A8: int8 or float8 with a scale a column, activations quantised per token) that the products multiply by; the
rest of the checkpoint (embedding, norms, an LM head left unquantized) is read as it is.

One module a format reads the matrices (models/compressed_tensors.py, fp8_checkpoint.py, awq.py, gptq.py, sharing
models/packed_weights.py); here they are picked by `quant_method`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

import numpy as np

from jpaged.models import awq, compressed_tensors, fp8_checkpoint, gptq, mxfp4
from jpaged.models.packed_weights import FormatReader, Matrix
from jpaged.models.params import GetTensor, dequantized

logger = logging.getLogger(__name__)

FORMATS: dict[str, Callable[[dict], FormatReader]] = {
    "compressed-tensors": compressed_tensors.reader,
    "fp8": fp8_checkpoint.reader,
    "awq": awq.reader,
    "gptq": gptq.reader,
    "mxfp4": mxfp4.reader,
}


def quantized_reader(
    quantization: dict, get: GetTensor, names: Collection[str], *, keep: bool = True
) -> GetTensor:
    """`get` for a checkpoint with this `quantization_config`: a quantized module's `.weight` (or a quantized tensor
    named without it, gpt-oss's experts) comes kept (or, without `keep`, dequantised to float32, for tensor
    parallelism and --quantization), other names as stored."""
    method = quantization.get("quant_method")
    if method not in FORMATS:
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported (supported: {', '.join(FORMATS)})"
        )
    matrix_of = FORMATS[method](quantization)
    logger.info(
        "checkpoint quantized with %s: its matrices are %s", method, "kept" if keep else "dequantised"
    )

    def read(name: str) -> np.ndarray | Matrix:
        matrix = matrix_of(name.removesuffix(".weight"), get, names)
        if matrix is not None:
            return matrix if keep else dequantized(matrix)
        return get(name)

    return read
