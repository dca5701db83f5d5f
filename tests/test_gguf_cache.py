"""A GGUF file is parsed and dequantised once; later loads read the cached float32 conversion."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest

from jpaged.models import gguf_cache, loader
from jpaged.models.loader import load_model


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JPAGED_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_second_load_reads_the_cached_conversion(cache_dir, default_gguf, monkeypatch):
    first = load_model(str(default_gguf), dtype=ml_dtypes.bfloat16, progress=False)
    assert gguf_cache.converted_dir(default_gguf).parent == cache_dir / "gguf"

    def no_parsing(*args):
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(loader, "read_gguf_fields", no_parsing)
    second = load_model(str(default_gguf), dtype=np.float32, progress=False)

    assert second.config == first.config
    text = "Bonjour สวัสดี 👋 <|im_start|>"
    assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    # The cache keeps float32 even when the first load asked for bfloat16.
    leaves = (jax.tree_util.tree_leaves(first.params), jax.tree_util.tree_leaves(second.params))
    for cold, warm in zip(*leaves, strict=True):
        assert warm.dtype == np.float32 and cold.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(warm.astype(ml_dtypes.bfloat16), cold)
    embed = second.params["embed"]["weight"]
    assert np.any(embed != embed.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_a_modified_file_is_converted_again(cache_dir, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    before = gguf_cache.converted_dir(path)
    path.write_bytes(b"GGUF but different")
    assert gguf_cache.converted_dir(path) != before
