"""Shared fixtures: the embedded model, its tokenizer, tiny random transformers models saved to disk, and the
engine and live server the server tests share (built by server_harness.py)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# dtype="auto" is bfloat16 on CPUs with bfloat16 dot products; the tests compare engines against float32
# references (transformers, numpy, each other across processes), so auto means float32 here on every CPU.
# test_engine_startup.py tests the choice itself.
os.environ.setdefault("JPAGED_CPU_AUTO_DTYPE", "float32")

import functools  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jpaged.models.default_model import default_model_path  # noqa: E402

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    vocab_size=49152,  # the default tokenizer's vocabulary, so tiny models can take text
    rms_norm_eps=1e-5,
)
MOE = dict(num_experts=8, num_experts_per_tok=2)


def _longrope(rotary_dim: int, **extra) -> dict:
    """Phi-3 LongRoPE over `rotary_dim` of TINY's head_dim 16, with a small original context (32) that prompts
    and generations cross."""
    half = rotary_dim // 2
    factors = dict(
        short_factor=[1.0 + 0.25 * i for i in range(half)], long_factor=[1.5 + i for i in range(half)]
    )
    scaling = dict(rope_type="longrope", **factors, **extra)
    return dict(max_position_embeddings=128, original_max_position_embeddings=32, rope_scaling=scaling)


TINY_FAMILIES = {
    "llama": ("LlamaConfig", dict(TINY)),
    "llama3_rope": (
        "LlamaConfig",
        dict(
            TINY,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "smollm2_tied": ("LlamaConfig", dict(TINY, tie_word_embeddings=True, rope_theta=100000.0)),
    "mistral_sliding": ("MistralConfig", dict(TINY, sliding_window=8)),
    "qwen2_bias": ("Qwen2Config", dict(TINY, tie_word_embeddings=True)),
    "qwen3_qk_norm": ("Qwen3Config", dict(TINY, head_dim=32)),
    "qwen3_yarn": (
        "Qwen3Config",
        dict(
            TINY,
            head_dim=32,
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
        ),
    ),
    "phi3": ("Phi3Config", dict(TINY, sliding_window=24)),  # Phi-3-mini's uniform window (its own: 2047)
    # LongRoPE with a small original context: prompts and generations cross it.
    "phi3_longrope": ("Phi3Config", dict(TINY, **_longrope(16))),
    # Phi-4-mini's shape: LongRoPE on the first 3/4 of head_dim, tied embeddings.
    "phi3_partial_rotary": (
        "Phi3Config",
        dict(TINY, tie_word_embeddings=True, **_longrope(12, partial_rotary_factor=0.75)),
    ),
    "llama_dynamic": (
        "LlamaConfig",
        dict(TINY, max_position_embeddings=32, rope_scaling=dict(rope_type="dynamic", factor=2.0)),
    ),
    # A sliding layer (window 8, which the prompts cross) then a global one; soft caps small enough to bite
    # on tiny random weights; a query_pre_attn_scalar that is not head_dim.
    "gemma2": (
        "Gemma2Config",
        dict(
            TINY,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=0.5,
            final_logit_softcapping=0.5,
        ),
    ),
    # Local, global, local: the local layers with an unscaled RoPE base of their own, the global one linearly
    # scaled (as Gemma 3 4B-27B), q/k norms.
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            TINY,
            num_hidden_layers=3,
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=100000.0),
                "sliding_attention": dict(rope_type="default", rope_theta=1000.0),
            },
        ),
    ),
    # Gemma 3 4B-27B's form: that text model inside an image-text one (a one-layer vision tower, never read).
    "gemma3_image_text": (
        "Gemma3Config",
        dict(
            text_config=dict(
                TINY, head_dim=32, query_pre_attn_scalar=24, sliding_window=8, sliding_window_pattern=2
            ),
            vision_config=dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            ),
            mm_tokens_per_image=4,
        ),
    ),
    # Mixtures of experts: 8 experts, 2 a token (MOE); Qwen3-MoE renormalising its top 2, Qwen2-MoE not and with
    # its shared expert, Mixtral's experts as wide as its config's intermediate_size.
    "qwen3_moe": ("Qwen3MoeConfig", dict(TINY, **MOE, moe_intermediate_size=32, norm_topk_prob=True)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(TINY, **MOE, moe_intermediate_size=32, shared_expert_intermediate_size=96),
    ),
    # gpt-oss: a sliding layer then a global one (window 8), YaRN, sinks, biased experts and a clamped SwiGLU.
    "gpt_oss": (
        "GptOssConfig",
        dict(
            TINY,
            head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=32,
            sliding_window=8,
            swiglu_limit=1.0,  # low enough that random weights reach the clamps
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(TINY, num_local_experts=8, num_experts_per_tok=2, intermediate_size=48),
    ),
}
PRE_NNX_FAMILIES = ("llama", "llama3_rope", "mistral_sliding", "qwen2_bias", "qwen3_qk_norm", "smollm2_tied")


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--async-scheduling",
        choices=("on", "off"),
        help="what async_scheduling=None (the default) means for every engine the tests build, on every "
        "platform: CI runs the engine tests both ways",
    )


def pytest_configure(config) -> None:
    choice = config.getoption("--async-scheduling")
    if choice is not None:
        from jpaged.config import ASYNC_SCHEDULING_DEFAULTS

        ASYNC_SCHEDULING_DEFAULTS.update(dict.fromkeys(ASYNC_SCHEDULING_DEFAULTS, choice == "on"))


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def default_tokenizer(default_gguf):
    from jpaged.models.loader import load_model

    return load_model(str(default_gguf), progress=False).tokenizer


@functools.cache
def _save_tiny(family: str, root: str) -> Path:
    import torch
    import transformers

    class_name, kwargs = TINY_FAMILIES[family]
    config = getattr(transformers, class_name)(**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if class_name.startswith("Gemma"):  # its norms start at w = 0, where a wrong (1 + w) would go unseen
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if name.endswith("norm.weight"):
                    weight.normal_(0.0, 0.5)
    if getattr(config, "num_experts_per_tok", None):  # decisive routers: no near-tie between two experts
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if name.endswith(("gate.weight", "router.weight")) and weight.shape[0] > 1:
                    weight.normal_(0.0, 1.0)
                elif name.endswith(("bias", "sinks")):  # at 0, a bias or sink lost on the way would go unseen
                    weight.normal_(0.0, 0.5)
    path = Path(root) / family
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_tokenizer):
    """A function family -> directory holding a tiny random transformers model and the default tokenizer."""
    root = tmp_path_factory.mktemp("tiny_models")

    def make(family: str) -> Path:
        path = _save_tiny(family, str(root))
        if not (path / "tokenizer_config.json").exists():
            default_tokenizer.save_pretrained(path)
        return path

    return make


@functools.cache
def hf_model(model_dir: Path):
    """The transformers reference model (PyTorch CPU, float32), loaded once per directory."""
    import torch
    import transformers

    if model_dir.is_file():  # a GGUF: transformers dequantises it itself
        return transformers.AutoModelForCausalLM.from_pretrained(
            model_dir.parent, gguf_file=model_dir.name, dtype=torch.float32
        ).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logits(model_dir: Path, token_ids: list[int]) -> np.ndarray:
    """Reference logits [T, V] from transformers."""
    import torch

    model = hf_model(model_dir)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].numpy()


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir):
    """The tiny random Llama, loaded once for every engine-level test that needs a fast model."""
    from jpaged.models.loader import load_model

    return load_model(str(tiny_llama_dir), progress=False)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """The AsyncLLMEngine the server tests share (server_harness.small_engine: one per process, so each step
    shape compiles once). A module that needs an engine of its own defines its own `engine` fixture."""
    from server_harness import small_engine

    return small_engine(tiny_model_dir)


@pytest.fixture(scope="module")
def http(engine):
    """An httpx client on a live server (served as "tiny") over `engine`, one server per module."""
    from server_harness import http_client

    with http_client(engine) as client:
        yield client


def pytest_terminal_summary(terminalreporter) -> None:
    """The figures the reliability tests recorded (figures.py), shown whether or not -s is on."""
    from figures import FIGURES

    if FIGURES:
        terminalreporter.section("figures")
        for title, text in FIGURES:
            terminalreporter.write_line(f"{title}:")
            for line in text.splitlines():
                terminalreporter.write_line(f"  {line}")
