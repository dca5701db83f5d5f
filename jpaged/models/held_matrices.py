"""Quantized matrices (GroupedMatrix, QuantizedMatrix) written as their plain arrays beside a form that puts them
back together: for the files that hold arrays only (the GGUF conversion cache's safetensors, orbax checkpoints).
A matrix at `path` is stored as `path{sep}{field}` for each of its arrays."""

from __future__ import annotations

import numpy as np

from jpaged.models.grouped import GROUPED_FIELDS, GroupedMatrix
from jpaged.models.quantized import QuantizedMatrix

_QUANTIZED_FIELDS = ("values", "scale")


def as_arrays(flat: dict, sep: str) -> tuple[dict, dict[str, dict]]:
    """Flat params -> (flat arrays, each quantized matrix's form by its path)."""
    arrays, forms = {}, {}
    for path, leaf in flat.items():
        if isinstance(leaf, GroupedMatrix):
            forms[path], fields = (
                dict(kind="grouped", bits=leaf.bits, transposed=leaf.transposed),
                GROUPED_FIELDS,
            )
        elif isinstance(leaf, QuantizedMatrix):
            static = ("input_scale",) if leaf.input_scale is not None else ()  # None is no array to write
            forms[path], fields = dict(kind="quantized"), _QUANTIZED_FIELDS + static
        else:
            arrays[path] = leaf
            continue
        arrays.update({f"{path}{sep}{field}": getattr(leaf, field) for field in fields})
    return arrays, forms


def from_arrays(arrays: dict, forms: dict[str, dict], dtype, sep: str) -> dict:
    """`as_arrays` undone: float arrays cast to `dtype`, quantized matrices rebuilt (a GroupedMatrix standing for
    `dtype`; a QuantizedMatrix without a stored input_scale quantises activations per token). A form without a
    kind is a GroupedMatrix's (the conversion cache's first forms)."""
    flat, fields = {}, {}
    for name, array in arrays.items():
        path, _, field = name.rpartition(sep)
        if path in forms:
            fields.setdefault(path, {})[field] = array
        else:
            flat[name] = np.asarray(array).astype(dtype, copy=False)
    for path, form in forms.items():
        form = dict(form)
        if form.pop("kind", "grouped") == "grouped":
            flat[path] = GroupedMatrix(**fields[path], **form, dtype=np.dtype(dtype))
        else:
            flat[path] = QuantizedMatrix(**fields[path])
    return flat
