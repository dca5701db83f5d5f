"""Model config and tokenizer from a GGUF file's metadata, read with the `gguf` library.

transformers can do both, but its GGUF path imports PyTorch, which jpaged does not depend on at run time; the
tests check that these give the same config and the same token ids as transformers does, and, where transformers
leaves a key llama.cpp writes unread (Phi-3's window, Gemma's soft caps, layer pattern and local RoPE), the config
of the checkpoint the GGUF was converted from (tests/test_gguf_families.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jpaged.models.config import ModelConfig
from jpaged.models.families import family_of, gguf_family

if TYPE_CHECKING:
    from jpaged.models.families.family import Family

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def read_gguf_fields(path: Path) -> dict[str, Any]:
    """Every metadata key of the file with its decoded value (arrays as lists)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read GGUF model {path}: {err}") from err
    fields = {name: field.contents() for name, field in reader.fields.items()}
    fields["_tensor_names"] = {t.name for t in reader.tensors}
    return fields


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
    family = _family(arch)

    def get(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    tensors = fields["_tensor_names"]
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
    extra = _ARCHITECTURE_KEYS.get(arch)
    return {**hf, **extra(get, hf, tensors)} if extra else hf


def _phi3_keys(get, hf, tensors) -> dict[str, Any]:
    if "rope_factors_long.weight" in tensors:
        # llama.cpp stores LongRoPE's factors as tensors; transformers' GGUF loading drops them (and with them the
        # model's RoPE at every length), so jpaged refuses rather than run a different model.
        raise ValueError(
            "phi3 GGUF with LongRoPE (rope_factors_long/rope_factors_short tensors) is not supported; load the "
            "HF checkpoint instead"
        )
    # The checkpoint's window, as jpaged reads it from an HF config (llama.cpp's converter writes 0 for none, as
    # Phi-4). llama.cpp itself runs Phi-3 without it for now and transformers' GGUF loading drops it.
    return dict(sliding_window=get("attention.sliding_window") or None)


def _gemma_query_scalar(arch: str, hf: dict[str, Any]) -> float:
    """llama.cpp keeps no query_pre_attn_scalar: it takes hidden / heads for the 27B models (told by their layer
    count) and head_dim for the rest, as Google's gemma_pytorch configs do."""
    if hf["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]:
        return hf["hidden_size"] // hf["num_attention_heads"]
    return hf["head_dim"]


def _gemma2_keys(get, hf, tensors) -> dict[str, Any]:
    return dict(
        sliding_window=get("attention.sliding_window", 4096),
        attn_logit_softcapping=float(get("attn_logit_softcapping", 50.0)),
        final_logit_softcapping=float(get("final_logit_softcapping", 30.0)),
        query_pre_attn_scalar=_gemma_query_scalar("gemma2", hf),
    )


def _gemma3_keys(get, hf, tensors) -> dict[str, Any]:
    pattern = get("attention.sliding_window_pattern", 6)
    layers = (
        dict(sliding_window_pattern=pattern)
        if isinstance(pattern, int)
        else dict(layer_types=["sliding_attention" if s else "full_attention" for s in pattern])
    )
    return dict(
        sliding_window=get("attention.sliding_window"),
        rope_local_base_freq=float(get("rope.freq_base_swa", 10000.0)),
        query_pre_attn_scalar=_gemma_query_scalar("gemma3", hf),
        **layers,
    )


# What each architecture's GGUF says beyond the shared keys, as transformers' config keys.
_ARCHITECTURE_KEYS = {"phi3": _phi3_keys, "gemma2": _gemma2_keys, "gemma3": _gemma3_keys}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# GGUF architectures whose family does not declare `gguf_architecture` yet (families/*.py owns that field).
_UNDECLARED = {"phi3": "phi3", "gemma2": "gemma2", "gemma3": "gemma3_text"}


def _family(arch: str) -> Family:
    try:
        return gguf_family(arch)
    except ValueError:
        if arch not in _UNDECLARED:
            raise
        return family_of(_UNDECLARED[arch])


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
