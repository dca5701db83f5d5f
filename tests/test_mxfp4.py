"""gpt-oss's MXFP4 experts (models/mxfp4.py): dequantised as transformers dequantises them, on fresh random blocks
and scales; a checkpoint storing its experts that way loads to the weights of the same checkpoint stored in
float32."""

from __future__ import annotations

import json
import shutil

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from jpaged.models.loader import load_model
from jpaged.models.mxfp4 import dequantize


def random_mxfp4(rng, experts: int, rows: int, inputs: int) -> tuple[np.ndarray, np.ndarray]:
    blocks = rng.integers(0, 256, (experts, rows, inputs // 32, 16), dtype=np.uint8)
    scales = rng.integers(120, 130, (experts, rows, inputs // 32), dtype=np.uint8)
    return blocks, scales


def test_dequantised_as_transformers_does():
    blocks, scales = random_mxfp4(np.random.default_rng(0), 3, 24, 64)
    expected = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    )
    np.testing.assert_array_equal(dequantize(blocks, scales), expected.numpy())


def test_an_mxfp4_checkpoint_loads_as_its_float_twin(tiny_model_dir, tmp_path):
    source = tiny_model_dir("gpt_oss")
    tensors = load_file(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    rng = np.random.default_rng(1)
    quantized, dense = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = tensors[name].shape  # [E, in, out]
        blocks, scales = random_mxfp4(rng, experts, outputs, inputs)
        del quantized[name]
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        dense[name] = convert_moe_packed_tensors(
            torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
        ).numpy()
    for path, weights, quantization in (
        (
            tmp_path / "mxfp4",
            quantized,
            {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
        ),
        (tmp_path / "float", dense, None),
    ):
        shutil.copytree(source, path)
        save_file(weights, path / "model.safetensors")
        (path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    mxfp4, float32 = (load_model(str(tmp_path / name), progress=False) for name in ("mxfp4", "float"))
    for layer in ("experts_gate_up", "experts_down"):
        np.testing.assert_array_equal(
            np.asarray(mxfp4.params["layers"]["mlp"][layer]),
            np.asarray(float32.params["layers"]["mlp"][layer]),
        )
