"""Model config and tokenizer from a GGUF file's metadata, read with the `gguf` library.

transformers can do both, but its GGUF path imports PyTorch, which jpaged does not depend on at run time; the
tests check that these give the same config and the same token ids as transformers does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jpaged.models.config import ModelConfig
from jpaged.models.families import gguf_family

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
    arch = fields.get("general.architecture")
    family = gguf_family(arch)

    def get(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    num_heads = get("attention.head_count")
    hidden = get("embedding_length")
    scaling = None
    if get("rope.scaling.type") == "linear":
        scaling = (("factor", get("rope.scaling.factor")), ("rope_type", "linear"))
    eos = fields.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=family.model_type,
        vocab_size=get("vocab_size") or len(fields["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"),
        num_heads=num_heads,
        num_kv_heads=get("attention.head_count_kv") or num_heads,
        head_dim=get("attention.key_length") or hidden // num_heads,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=get("context_length", 2048),
        tie_word_embeddings="output.weight" not in fields["_tensor_names"],
        attention_bias="blk.0.attn_q.bias" in fields["_tensor_names"],
        qk_norm="blk.0.attn_q_norm.weight" in fields["_tensor_names"],
        rope_scaling=scaling,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
    )


def gguf_tokenizer(fields: dict[str, Any]):
    """A fast byte-level BPE tokenizer (GPT-2 style: SmolLM2, Llama 3, Qwen) built from the GGUF vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported yet (byte-level BPE 'gpt2' is)")
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
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
