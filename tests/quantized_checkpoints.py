"""Tiny AutoAWQ (GEMM) and AutoGPTQ (v1) checkpoints, written from a float one, each with its dequantised twin.

No CPU-installable tool writes these two 4-bit formats, so the tests write their own: round-to-nearest, one scale
and zero point per output feature and group of input features. Beside each checkpoint, `out / "dequantized"` is a
float32 checkpoint whose Linear weights are exactly what the quantised tensors decode to ((q - z) * s in float32,
s the stored float16 scale), so transformers gives the reference logits.

The layouts were checked against the libraries that read them, not against this file (tiny Llama, 256 wide):
  * AWQ: compressed-tensors 0.19's AutoAWQConverter turns the tensors into pack-quantized ones, which its own
    PackedQuantizationCompressor decodes to the dequantised weights bit for bit (`awq_matches_compressed_tensors`,
    which a test runs). By hand: gptqmodel 7.7's dequantize_gemm and TorchCpuAvx512AwqLinear decode them the same,
    and the model transformers 5.25 loads through gptqmodel (float16, CPU) gives logits within 9e-4 (relative to
    the largest) of the float32 twin's, where the unquantised model is 2e-1 away.
  * GPTQ, by hand: gptqmodel 7.7's TorchLinear.dequantize_weight, after its v1 -> v2 zero conversion (+1 per
    nibble), decodes them to the dequantised weights bit for bit (rounded to its float16), with and without
    desc_act, sym and not; loaded by transformers through gptqmodel, logits again within 9e-4 of the twin's.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

_LINEAR = re.compile(r"\.(self_attn\.(q|k|v|o|qkv)_proj|mlp\.(gate|up|down|gate_up)_proj)\.weight$")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column AWQ_ORDER[i] of its 8
# (module name, [out, in] float weight) -> (the format's tensors for that module, the dequantised weight)
Quantize = Callable[[str, np.ndarray], tuple[dict[str, np.ndarray], np.ndarray]]


def _quantize(w: np.ndarray, g_idx: np.ndarray, sym: bool, min_zero: int) -> tuple[np.ndarray, ...]:
    """[out, in] float weights -> codes [out, in], zeros and float16 scales [out, groups], dequantised [out, in]."""
    groups = int(g_idx.max()) + 1
    grouped = w[:, np.argsort(g_idx, kind="stable")].reshape(w.shape[0], groups, -1)
    lo, hi = grouped.min(-1), grouped.max(-1)
    if sym:  # GPTQ's symmetric grid: zero 8, codes 0..15 cover [-8s, 7s] with s = 2 max|w| / 15
        scale = np.maximum(-lo, hi) * 2 / 15
        zeros = np.full(scale.shape, 8)
    else:
        scale = (hi - lo) / 15
        zeros = np.clip(np.rint(-lo / np.maximum(scale, 1e-5)), min_zero, 15)
    scale = np.maximum(scale, 1e-5).astype(np.float16)
    s, z = scale.astype(np.float32)[:, g_idx], zeros[:, g_idx]
    codes = np.clip(np.rint(w / s) + z, 0, 15)
    return codes.astype(np.int64), zeros.astype(np.int64), scale, ((codes - z) * s).astype(np.float32)


def _pack(codes: np.ndarray, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """Eight 4-bit codes along the last axis per int32, nibble i holding code order[i] (high nibbles wrap to < 0)."""
    eight = codes.reshape(*codes.shape[:-1], -1, 8)[..., list(order)].astype(np.uint32)
    return (eight << (4 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint32).view(np.int32)


def _awq_tensors(name: str, w: np.ndarray, *, group_size: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """AutoAWQ's WQLinear_GEMM: codes and zeros packed along the outputs in AWQ_ORDER, tensors [in, out]."""
    codes, zeros, scale, dequantized = _quantize(w, np.arange(w.shape[1]) // group_size, False, 0)
    return {
        f"{name}.qweight": _pack(codes.T, AWQ_ORDER),
        f"{name}.qzeros": _pack(zeros.T, AWQ_ORDER),
        f"{name}.scales": scale.T,
    }, dequantized


def _gptq_tensors(
    name: str, w: np.ndarray, *, group_size: int, desc_act: bool, sym: bool, seed: int
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """AutoGPTQ's v1 QuantLinear: codes packed along the inputs, zeros (less one) along the outputs."""
    g_idx = np.arange(w.shape[1]) // group_size
    if desc_act:  # act-order: groups follow a permutation of the input features, rows stay in place
        perm = np.random.default_rng(seed).permutation(w.shape[1])
        g_idx[perm] = np.arange(w.shape[1]) // group_size
    # v1 stores zero - 1 in a nibble (readers add 1 per nibble, carrying), so a zero of 0 has no code: keep 1..15
    codes, zeros, scale, dequantized = _quantize(w, g_idx, sym, 1)
    return {
        f"{name}.qweight": _pack(codes).T,
        f"{name}.qzeros": _pack(zeros.T - 1),
        f"{name}.scales": scale.T,
        f"{name}.g_idx": g_idx.astype(np.int32),
    }, dequantized


def _write(float_dir: Path, out: Path, quantization_config: dict, quantize: Quantize) -> Path:
    """Write `out` and `out / "dequantized"`, quantising each decoder-layer Linear weight with `quantize`."""
    group_size = quantization_config["group_size"]
    quantized, dequantized = {}, {}
    for name, tensor in load_file(float_dir / "model.safetensors").items():
        if not _LINEAR.search(name):
            quantized[name] = dequantized[name] = tensor
            continue
        if tensor.shape[1] % group_size or tensor.shape[0] % 8:
            raise ValueError(f"{name} {tensor.shape} does not split into groups of {group_size} inputs")
        tensors, dequantized[name] = quantize(name.removesuffix(".weight"), tensor.astype(np.float32))
        quantized |= tensors
    config = json.loads((float_dir / "config.json").read_text())
    for directory, weights, extra in (
        (out, quantized, {"quantization_config": quantization_config}),
        (out / "dequantized", dequantized, {}),
    ):
        directory.mkdir(parents=True, exist_ok=True)
        for path in float_dir.iterdir():
            if (
                path.is_file()
                and path.name != "config.json"
                and not path.name.startswith("model.safetensors")
            ):
                shutil.copy(path, directory / path.name)
        (directory / "config.json").write_text(json.dumps(config | extra, indent=2))
        # safetensors.numpy writes an array's memory as it lies, so a transposed view would land transposed
        contiguous = {name: np.ascontiguousarray(tensor) for name, tensor in weights.items()}
        save_file(contiguous, directory / "model.safetensors", metadata={"format": "pt"})
    return out


def write_awq(float_dir: Path, out: Path, group_size: int = 128) -> Path:
    """An AutoAWQ GEMM checkpoint (asymmetric, zero_point true) of the float model at `float_dir`."""
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True}
    config |= {"version": "gemm", "modules_to_not_convert": None}
    return _write(float_dir, out, config, partial(_awq_tensors, group_size=group_size))


def write_gptq(
    float_dir: Path,
    out: Path,
    group_size: int = 128,
    *,
    desc_act: bool = False,
    sym: bool = True,
    seed: int = 0,
) -> Path:
    """An AutoGPTQ v1 checkpoint (checkpoint_format "gptq") of the float model at `float_dir`."""
    config = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym}
    config |= {"checkpoint_format": "gptq", "true_sequential": True, "damp_percent": 0.01}
    config |= {"static_groups": False, "modules_in_block_to_quantize": None}
    gptq = partial(_gptq_tensors, group_size=group_size, desc_act=desc_act, sym=sym, seed=seed)
    return _write(float_dir, out, config, gptq)


def awq_matches_compressed_tensors(out: Path) -> bool:
    """Whether compressed-tensors, converting `out`'s AWQ tensors and decoding them, gets the dequantised weights."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from safetensors.torch import load_file as load_torch

    converter = AutoAWQConverter.from_pretrained(str(out))
    scheme = converter._build_quant_config().config_groups["config_group_0"]
    converted = converter.process(load_torch(out / "model.safetensors"))
    for name, expected in load_torch(out / "dequantized" / "model.safetensors").items():
        if not _LINEAR.search(name):
            continue
        module = name.removesuffix(".weight")
        state = {
            key: converted[f"{module}.{key}"]
            for key in ("weight_packed", "weight_zero_point", "weight_shape")
        }
        state["weight_scale"] = converted[
            f"{module}.weight_scale"
        ].float()  # decode in float32, as the twin is
        if not torch.equal(PackedQuantizationCompressor.decompress(state, scheme)["weight"], expected):
            return False
    return True
