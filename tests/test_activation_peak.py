"""Accelerator KV sizing subtracts the step's measured activation peak (XLA's compiled memory analysis)."""

from __future__ import annotations

from jpaged.config import EngineConfig
from jpaged.models.loader import load_model
from jpaged.runner.activation_peak import activation_peak_bytes


def test_activation_peak_is_measured_and_grows_with_the_token_budget(tiny_model_dir):
    model = load_model(str(tiny_model_dir("llama")), progress=False)
    small, large = (
        activation_peak_bytes(
            EngineConfig(max_num_seqs=8, max_num_batched_tokens=tokens), model.config, model.params, 256
        )
        for tokens in (64, 8192)
    )
    assert 0 < small < large
