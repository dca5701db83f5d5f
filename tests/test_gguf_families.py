"""A GGUF of Phi-3, Gemma 2 or Gemma 3 written as llama.cpp's converter writes one (gguf's own tensor names, Gemma's
norms stored as 1 + w, F32 vectors and Q8_0 matrices) loads into the params transformers' own GGUF loading reads,
and into the config of the model it was converted from, less what a GGUF does not hold; a Phi-3 with LongRoPE
(factor tensors, which transformers drops) loads as its checkpoint and generates as it does; its SentencePiece
vocabulary (the kind Phi-3's and Gemma's GGUFs carry) tokenizes as transformers' GGUF tokenizer does."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_loaders import assert_same_params

from jpaged import LLM, SamplingParams
from jpaged.models.config import ModelConfig
from jpaged.models.gguf_metadata import gguf_model_config, read_gguf_fields
from jpaged.models.loader import load_model
from jpaged.models.params import params_from_hf_names

# tiny_model_dir's family -> llama.cpp's `general.architecture`
GGUF_ARCHITECTURES = {
    "phi3": "phi3",
    "phi3_longrope": "phi3",
    "phi3_partial_rotary": "phi3",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
}
# What transformers' GGUF config reading leaves at its config class's defaults (it maps fewer keys than
# llama.cpp writes); jpaged reads these as llama.cpp does.
TRANSFORMERS_DROPS = {
    "phi3": {"sliding_window"},
    "gemma2": {"query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"},
    "gemma3": {"query_pre_attn_scalar", "sliding_layers", "local_rope_theta", "rope_scaling"},
}


@pytest.fixture
def gguf_of(tiny_model_dir, default_gguf, tmp_path, monkeypatch):
    """(family, vocabulary=the default model's first tokens, quantize=True, qtype="Q8_0") -> a GGUF converted
    from tiny_model_dir(family)."""
    monkeypatch.setenv("JPAGED_CACHE_DIR", str(tmp_path / "cache"))

    def make(family: str, vocabulary=None, quantize: bool = True, qtype: str = "Q8_0") -> Path:
        path = tmp_path / f"{family}-{qtype if quantize else 'F32'}.gguf"
        vocabulary = vocabulary or functools.partial(byte_level_vocabulary, default_gguf)
        write_gguf(tiny_model_dir(family), path, GGUF_ARCHITECTURES[family], vocabulary, quantize, qtype)
        return path

    return make


@pytest.mark.parametrize("family", ["phi3", "gemma2", "gemma3"])
def test_gguf_params_equal_transformers_gguf_loading(family, gguf_of, tiny_model_dir):
    import torch
    import transformers

    path = gguf_of(family)
    ours = load_model(str(path), progress=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    state = {k: v.numpy() for k, v in reference.state_dict().items()}
    assert_same_params(ours.params, params_from_hf_names(ours.config, state.__getitem__, np.float32))

    source = as_in_gguf(
        ModelConfig.from_hf_config(json.loads((tiny_model_dir(family) / "config.json").read_text()))
    )
    if family.startswith("gemma"):  # not in a GGUF: llama.cpp takes head_dim below 27B
        source = dataclasses.replace(source, query_pre_attn_scalar=float(source.head_dim))
    assert ours.config == source

    theirs = ModelConfig.from_hf_config(reference.config.to_dict())
    differ = {
        f.name
        for f in dataclasses.fields(ModelConfig)
        if getattr(ours.config, f.name) != getattr(theirs, f.name)
    }
    assert differ == TRANSFORMERS_DROPS[family]


def as_in_gguf(config: ModelConfig) -> ModelConfig:
    """The config less what its GGUF cannot say alike: GGUF's float32 epsilon, and the ids of the tokenizer the
    GGUF was given."""
    return dataclasses.replace(
        config, rms_norm_eps=float(np.float32(config.rms_norm_eps)), bos_token_id=1, eos_token_ids=(2,)
    )


LONGROPE = ["phi3_longrope", "phi3_partial_rotary"]  # Phi-3-mini-128k / Phi-3.5-mini's shape, Phi-4-mini's


@pytest.mark.parametrize("family", LONGROPE)
def test_a_phi3_gguf_with_longrope_loads_the_config_and_params_of_its_checkpoint(
    family, gguf_of, tiny_model_dir
):
    # Unquantized, so that the params are the checkpoint's own.
    path = gguf_of(family, quantize=False)
    ours = load_model(str(path), progress=False)
    checkpoint = load_model(str(tiny_model_dir(family)), progress=False)
    # What the test is about, were both configs to lose it.
    assert ours.config.rope_scaling_dict["long_factor"]
    assert ours.config == as_in_gguf(checkpoint.config)
    assert_same_params(ours.params, checkpoint.params)
    assert load_model(str(path), progress=False).config == ours.config  # read back from its converted copy


def test_a_longrope_attention_factor_other_than_the_contexts_give_is_kept(gguf_of):
    """llama.cpp's converter always writes the factor the two contexts give (the config then names none); a file
    whose factor differs (another converter's) keeps it."""
    fields = read_gguf_fields(gguf_of("phi3_longrope"))
    assert "attention_factor" not in gguf_model_config(fields).rope_scaling_dict
    fields["phi3.rope.scaling.attn_factor"] = 1.5
    assert gguf_model_config(fields).rope_scaling_dict["attention_factor"] == 1.5


@pytest.mark.parametrize("family", LONGROPE)
def test_a_phi3_gguf_with_longrope_generates_as_its_checkpoint_across_the_original_context(
    family, gguf_of, tiny_model_dir
):
    # Prompts ending before the original context (32; decoding crosses it) and past it. The two tokenizers differ:
    # token ids and logprobs only.
    prompts = [{"prompt_token_ids": [(7 * i + 3) % 250 + 3 for i in range(n)]} for n in (28, 45)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    outputs = {}
    for name, model in (("gguf", gguf_of(family, quantize=False)), ("checkpoint", tiny_model_dir(family))):
        llm = LLM(str(model), max_model_len=64, max_num_seqs=2, enforce_eager=True)
        outputs[name] = [
            (
                o.outputs[0].token_ids,
                [{t: p.logprob for t, p in step.items()} for step in o.outputs[0].logprobs],
            )
            for o in llm.generate(prompts, params, use_tqdm=False)
        ]
    assert outputs["gguf"] == outputs["checkpoint"]


def write_gguf(
    model_dir: Path, path: Path, arch: str, vocabulary, quantize: bool = True, qtype: str = "Q8_0"
) -> None:
    """A small llama.cpp converter: the model's safetensors under gguf's names for `arch` (matrices as `qtype` if
    `quantize`, else F32), LongRoPE's factors as llama.cpp's Phi-3 converter writes them, and llama.cpp's metadata
    keys for it; `vocabulary(writer)` writes the tokenizer's."""
    import gguf
    from safetensors.numpy import load_file

    hf = json.loads((model_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, arch, hf)
    vocabulary(writer)
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), 8)
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        tensor = tensor.astype(np.float32)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1  # llama.cpp's Gemma converter
        if quantize and tensor.ndim == 2 and tensor.shape[-1] % 32 == 0:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(gguf_name, gguf.quants.quantize(tensor, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, tensor)
    scaling = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if scaling.get("long_factor"):  # llama.cpp's Phi-3 LongRoPE (Phi3MiniModel.generate_extra_tensors)
        for kind in ("long", "short"):
            name = gguf.TENSOR_NAMES[getattr(gguf.MODEL_TENSOR, f"ROPE_FACTORS_{kind.upper()}")] + ".weight"
            writer.add_tensor(name, np.asarray(scaling[f"{kind}_factor"], np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_metadata(writer, arch: str, hf: dict) -> None:
    import gguf

    writer.add_vocab_size(hf["vocab_size"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    rope = hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta", 10000.0)}
    if arch == "phi3":
        head_dim = hf["hidden_size"] // hf["num_attention_heads"]
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        writer.add_rope_freq_base(rope["rope_theta"])
        original = hf["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_sliding_window(hf.get("sliding_window") or 0)
        if rope.get("rope_type") == "longrope":  # its attention factor from the contexts, whatever the config
            scale = hf["max_position_embeddings"] / original
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
            )
        return
    writer.add_key_length(hf["head_dim"])
    writer.add_value_length(hf["head_dim"])
    writer.add_sliding_window(hf["sliding_window"])
    if arch == "gemma2":
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_attn_logit_softcapping(hf["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(hf["final_logit_softcapping"])
        return
    full, local = rope["full_attention"], rope["sliding_attention"]
    writer.add_rope_freq_base(full["rope_theta"])
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    # Keys llama.cpp reads for other interleaved-window architectures; its Gemma 3 assumes 10000 and 5:1.
    writer.add_rope_freq_base_swa(local["rope_theta"])
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in hf["layer_types"]])


def byte_level_vocabulary(tokenizer_gguf: Path, writer) -> None:
    """The first 256 tokens of `tokenizer_gguf`'s byte-level vocabulary, without merges (a whole vocabulary takes
    seconds to read and write); bos 1, eos 2."""
    import gguf

    fields = gguf.GGUFReader(str(tokenizer_gguf)).fields
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(fields["tokenizer.ggml.tokens"].contents(slice(0, 256)))
    writer.add_token_types(fields["tokenizer.ggml.token_type"].contents(slice(0, 256)))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def sentencepiece_vocabulary(writer) -> None:
    """A small SentencePiece vocabulary as llama.cpp writes one (Phi-3's and Gemma's are): pieces with scores and no
    merges, byte fallback tokens, control tokens for <unk>, <s>, </s> and a chat turn's end."""
    pieces = [
        "\u2581",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "\u2581h",
        "ll",
        "llo",
        "\u2581he",
        "\u2581hello",
        "\u2581w",
    ]
    pieces += ["or", "\u2581wor", "\u2581world", "\u2581\u2581"]
    tokens = ["<unk>", "<s>", "</s>", "<|end|>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (4 + 256) + [-float(i) for i in range(len(pieces))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}<|end|>{% endfor %}")


@pytest.mark.parametrize("family", ["phi3", "gemma2"])
def test_a_sentencepiece_vocabulary_tokenizes_as_transformers_gguf_tokenizer(family, gguf_of):
    import transformers

    path = gguf_of(family, sentencepiece_vocabulary)
    ours = load_model(str(path), progress=False).tokenizer
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ["hello world", " hello  world", "hello<|end|>world", "héllo wörld 😀", ""]:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text)), text
    messages = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(messages, tokenize=False) == reference.apply_chat_template(
        messages, tokenize=False
    )
