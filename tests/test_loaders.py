"""Every loader yields the same params pytree: GGUF, HF safetensors (sharded or not) and orbax."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jpaged.models.checkpoint import save_checkpoint
from jpaged.models.loader import load_model, resolve_model
from jpaged.models.params import params_from_hf_names


def assert_same_params(actual: dict, expected: dict, rtol: float = 0.0) -> None:
    flat_actual = jax.tree_util.tree_leaves_with_path(actual)
    flat_expected = jax.tree_util.tree_leaves_with_path(expected)
    assert [p for p, _ in flat_actual] == [p for p, _ in flat_expected]
    for (path, a), (_, e) in zip(flat_actual, flat_expected, strict=True):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=0, err_msg=jax.tree_util.keystr(path))


def test_gguf_params_equal_transformers_gguf_loading(default_gguf):
    import torch
    import transformers

    ours = load_model(str(default_gguf), progress=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32
    )
    state = {k: v.numpy() for k, v in reference.state_dict().items()}
    expected = params_from_hf_names(ours.config, state.__getitem__, np.float32, progress=False)
    assert_same_params(ours.params, expected, rtol=1e-6)
    assert ours.config.eos_token_ids == (2,)  # <|im_end|> ends a turn
    assert ours.tokenizer.chat_template is not None


def test_gguf_config_and_tokenizer_equal_transformers_own(default_gguf, default_tokenizer):
    import transformers

    from jpaged.models.config import ModelConfig

    hf_config = transformers.AutoConfig.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    assert load_model(str(default_gguf), progress=False).config == ModelConfig.from_hf_config(
        hf_config.to_dict()
    )
    reference = transformers.AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    texts = [
        "Hello world!",
        "ประเทศไทยมีจังหวัด",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
        "def f(x):\n  return 1  # 😀 中文",
    ]
    for text in texts:
        assert default_tokenizer.encode(text) == reference.encode(text)
        assert default_tokenizer.decode(reference.encode(text)) == reference.decode(reference.encode(text))
    messages = [{"role": "user", "content": "hi"}]
    assert default_tokenizer.apply_chat_template(messages, tokenize=False) == reference.apply_chat_template(
        messages, tokenize=False
    )


def test_sharded_safetensors_load_like_a_single_file(tiny_model_dir, tmp_path, default_tokenizer):
    import transformers

    single = tiny_model_dir("llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(single)
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    default_tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert_same_params(
        load_model(str(tmp_path), progress=False).params, load_model(str(single), progress=False).params
    )


@pytest.mark.parametrize("family", ["qwen2_bias", "qwen3_qk_norm", "qwen2_moe", "gpt_oss", "default"])
def test_lazy_weights_read_what_the_whole_arrays_hold_at_any_part(family, tiny_model_dir, default_gguf):
    """A lazy weight (tensor parallelism's loading) has its leaf's shape and dtype, and any part of it (slices,
    the last axis also as gathered columns in any order, which is how a shard takes its fused columns) is that
    part of the eagerly loaded array: from HF safetensors (a mixture's expert stacks [L, E, ...] by layers and
    experts too, gpt-oss's interleaved gate/up as gate | up) and from the GGUF conversion cache."""
    model = str(default_gguf if family == "default" else tiny_model_dir(family))
    eager = load_model(model, progress=False).params  # also fills the GGUF conversion cache
    lazy = load_model(model, progress=False, lazy=True).params
    rng = np.random.default_rng(0)
    for (path, whole), weight in zip(
        jax.tree_util.tree_leaves_with_path(eager), jax.tree_util.tree_leaves(lazy), strict=True
    ):
        name = jax.tree_util.keystr(path)
        assert (weight.shape, weight.dtype, weight.nbytes) == (whole.shape, whole.dtype, whole.nbytes), name
        np.testing.assert_array_equal(np.asarray(weight), whole, err_msg=name)
        for _ in range(3):
            lows = [int(rng.integers(size)) for size in whole.shape[:-1]]
            lead = tuple(
                slice(lo, int(rng.integers(lo + 1, size + 1)))
                for lo, size in zip(lows, whole.shape[:-1], strict=True)
            )
            columns = rng.choice(whole.shape[-1], size=1 + int(rng.integers(whole.shape[-1])), replace=False)
            index = (*lead, columns)
            np.testing.assert_array_equal(weight[index], whole[index], err_msg=name)


@pytest.mark.parametrize("family", ["qwen3_qk_norm", "gemma3"])
def test_orbax_checkpoint_round_trip(family, tiny_model_dir, tmp_path):
    source = load_model(str(tiny_model_dir(family)), progress=False)
    save_checkpoint(tmp_path / "ckpt", source.config, source.params, source.tokenizer)
    assert resolve_model(str(tmp_path / "ckpt")).kind == "orbax"
    restored = load_model(str(tmp_path / "ckpt"), progress=False)
    assert restored.config == source.config
    assert_same_params(restored.params, source.params)
    assert restored.tokenizer.encode("hello world") == source.tokenizer.encode("hello world")


def test_a_non_gguf_file_is_rejected(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match="not a .gguf file"):
        load_model(str(path), progress=False)
