"""RMSNorm in bfloat16 rounds where each family's transformers module rounds: Llama's (and the MoE families')
scales the normalised x after rounding it, gpt-oss's in float32 before rounding, Gemma's by (1 + w) in float32."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from jpaged.models.llama import RMSNorm

RULES = {  # transformers' module, and RMSNorm's (offset, in_float32)
    "llama": (LlamaRMSNorm, 0.0, False),
    "gpt_oss": (GptOssRMSNorm, 0.0, True),
    "gemma2": (Gemma2RMSNorm, 1.0, False),
}


@pytest.mark.parametrize("family", sorted(RULES))
def test_bfloat16_norm_rounds_as_the_familys_transformers_module(family):
    module, offset, in_float32 = RULES[family]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 96)).astype(np.float32) * 3
    w = rng.standard_normal(96).astype(np.float32)
    reference = module(96, eps=1e-5)
    with torch.no_grad():
        reference.weight.copy_(torch.from_numpy(w))
        expected = reference.to(torch.bfloat16)(torch.from_numpy(x).to(torch.bfloat16)).float().numpy()
    ours = RMSNorm(96, 1e-5, jnp.bfloat16, "embed", offset, in_float32)
    ours.weight[...] = jnp.asarray(w, jnp.bfloat16)
    got = np.asarray(ours(jnp.asarray(x, jnp.bfloat16)), np.float32)
    np.testing.assert_array_equal(got, expected)
