"""Model config and tokenizer from a GGUF file's metadata, read with the `gguf` library.

transformers can do both, but its GGUF path imports PyTorch, which jpaged does not depend on at run time; the
tests check that these give the same config and the same token ids as transformers does, and, where transformers
leaves a key llama.cpp writes unread (Phi-3's window and LongRoPE factors, Gemma's soft caps, layer pattern and
local RoPE), the config of the checkpoint the GGUF was converted from (tests/test_gguf_families.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jpaged.models.config import ModelConfig
from jpaged.models.families import gguf_family

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def read_gguf_fields(path: Path) -> dict[str, Any]:
    """Every metadata key of the file with its decoded value (arrays as lists); `_tensors`: its tensors by name."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read GGUF model {path}: {err}") from err
    fields = {name: field.contents() for name, field in reader.fields.items()}
    fields["_tensors"] = GGUFTensors(reader.tensors)
    return fields


class GGUFTensors(Mapping[str, np.ndarray]):
    """A GGUF's tensors by name, each dequantised to float32 in transformers' shape when looked up; the file is
    memory-mapped, so naming them reads nothing and looking one up reads only it (for metadata kept as tensors,
    such as Phi-3's LongRoPE factors)."""

    def __init__(self, tensors) -> None:
        self._tensors = {tensor.name: tensor for tensor in tensors}

    def stored(self, name: str):
        """Tensor `name` as the file stores it (gguf's ReaderTensor: its block type, shape and memory-mapped data)."""
        return self._tensors[name]

    def __getitem__(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        tensor = self._tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape))
        return dequantize(tensor.data, tensor.tensor_type).reshape(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def gguf_model_config(fields: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a GGUF file: its metadata as transformers' config.json keys, read by the family as an HF
    config is, then what only the GGUF says (partial rotary from the RoPE dimension count)."""
    hf = gguf_hf_config(fields)
    config = ModelConfig.from_hf_config(hf)
    rope_dims = fields.get(f"{fields['general.architecture']}.rope.dimension_count")
    if rope_dims and rope_dims < config.head_dim:
        config = dataclasses.replace(config, rotary_dim=rope_dims)
    return config


def gguf_hf_config(fields: dict[str, Any]) -> dict[str, Any]:
    """transformers' config.json keys from llama.cpp's metadata, with the defaults llama.cpp assumes where its
    converter writes nothing."""
    arch = fields.get("general.architecture")
    family = gguf_family(arch)

    def get(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    tensors = fields["_tensors"]
    heads = get("attention.head_count")
    hidden = get("embedding_length")
    scaling = None
    if get("rope.scaling.type") == "linear":
        scaling = dict(rope_type="linear", factor=get("rope.scaling.factor"))
    hf = dict(
        model_type=family.model_type,
        vocab_size=get("vocab_size") or len(fields["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv") or heads,
        head_dim=get("attention.key_length") or hidden // heads,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=get("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
    )
    return {**hf, **family.gguf_config(get, hf, tensors)} if family.gguf_config else hf


def gguf_tokenizer(fields: dict[str, Any]):
    """A fast tokenizer from the GGUF vocabulary: byte-level BPE ('gpt2': SmolLM2, Llama 3, Qwen, Phi-4) built here,
    SentencePiece ('llama': Phi-3, Gemma 2/3) as transformers builds it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = fields.get("tokenizer.ggml.model")
    if kind == "llama":
        return _sentencepiece_tokenizer(fields)
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported yet (byte-level BPE 'gpt2' and SentencePiece 'llama' are)"
        )
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    # gguf writes no empty array: a vocabulary without merges has no merges key
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    add_prefix_space = bool(fields.get("tokenizer.ggml.add_space_prefix", False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    types = fields.get("tokenizer.ggml.token_type") or []
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=t == _CONTROL, normalized=False)
            for i, t in enumerate(types)
            if t in (3, 4)
        ]
    )

    def token(key: str) -> str | None:
        index = fields.get(f"tokenizer.ggml.{key}_token_id")
        return None if index is None else tokens[index]

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=fields.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def _sentencepiece_tokenizer(fields: dict[str, Any]):
    """transformers' own builder for a GGUF's SentencePiece vocabulary, which imports no PyTorch: it rebuilds the
    merges the file leaves out, and Phi-3's and Gemma's spellings by architecture (its module says why)."""
    from transformers import PreTrainedTokenizerFast

    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError as err:
        raise ValueError(
            "a SentencePiece GGUF vocabulary ('llama') needs transformers' integrations.gguf (transformers 5)"
        ) from err

    def renamed(group: str) -> dict[str, Any]:
        keys = GGUF_TOKENIZER_MAPPING[group].items()
        return {name: fields[f"tokenizer.{key}"] for key, name in keys if f"tokenizer.{key}" in fields}

    vocabulary, settings = renamed("tokenizer"), renamed("tokenizer_config")
    settings.setdefault("add_bos_token", True)  # llama.cpp's default for a SentencePiece vocabulary
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        index = fields.get(f"tokenizer.ggml.{key}_token_id")
        settings[f"{name}_token"] = None if index is None else vocabulary["tokens"][index]
    backend, _ = convert_gguf_tokenizer(fields["general.architecture"], vocabulary)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **settings)
