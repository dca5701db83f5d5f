"""A decoder run as an embedding model (runner="pooling", convert="embed"): `LLM.embed` equals transformers'
hidden states pooled as the model's sentence-transformers config says (last token, mean, CLS; normalised or not),
within 1e-4 in float32, alone or batched, chunked or not; Matryoshka truncation where the model allows it; KV
blocks all free afterwards; a warmed pooling engine compiles nothing."""

from __future__ import annotations

import numpy as np
import pytest
from embedding_models import hf_embedding, save_embedding_model

from jpaged.entrypoints.llm import LLM
from jpaged.pooling_params import PoolingParams
from jpaged.sampling_params import SamplingParams

# A token budget of 32 per step: the longest prompt below (70+ tokens) runs in three chunks.
ENGINE_ARGS = dict(
    runner="pooling", convert="embed", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256
)
PROMPTS = [
    "The quick brown fox",
    "jumps",
    "over the lazy dog, " * 12,  # longer than one step's token budget
    "Embeddings map text to vectors.",
    "Hello hello hello world",
]
CASES = [("qwen3", "last", True), ("llama", "mean", True), ("llama", "cls", True), ("llama", "mean", False)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_tokenizer):
    root = str(tmp_path_factory.mktemp("embedding_models"))
    return lambda *args, **kwargs: save_embedding_model(root, *args, tokenizer=default_tokenizer, **kwargs)


_llms: dict = {}


def pooling_llm(path, **overrides) -> LLM:
    """One eager engine per model directory (each step shape compiles on first use)."""
    key = (str(path), tuple(sorted(overrides.items())))
    if key not in _llms:
        _llms[key] = LLM(str(path), enforce_eager=True, **{**ENGINE_ARGS, **overrides})
    return _llms[key]


def vectors(outputs) -> np.ndarray:
    return np.array([o.outputs.embedding for o in outputs])


def assert_no_blocks_held(llm: LLM) -> None:
    assert not llm.engine.has_unfinished()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_total_blocks


@pytest.mark.parametrize("family, pooling, normalize", CASES, ids=[f"{f}-{p}-{n}" for f, p, n in CASES])
def test_embeddings_equal_transformers_pooled_hidden_states(model_dir, family, pooling, normalize):
    path = model_dir(family, pooling, normalize)
    llm = pooling_llm(path)
    outputs = llm.embed(PROMPTS, use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outputs) > ENGINE_ARGS["max_num_batched_tokens"]
    for output in outputs:
        expected = hf_embedding(path, output.prompt_token_ids, pooling, normalize)
        np.testing.assert_allclose(output.outputs.embedding, expected, atol=1e-4, rtol=0)
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(vectors(outputs), axis=1), 1.0, atol=1e-5)
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_a_batch_embeds_as_its_prompts_one_by_one(model_dir, pooling):
    llm = pooling_llm(model_dir("llama", pooling))
    batch = vectors(llm.embed(PROMPTS, use_tqdm=False))
    alone = np.concatenate([vectors(llm.embed(p, use_tqdm=False)) for p in PROMPTS])
    np.testing.assert_allclose(batch, alone, atol=1e-5, rtol=0)


def test_a_prompt_over_the_token_budget_pools_over_all_its_tokens(model_dir):
    """Mean pooling adds the chunks' sums: a prompt in three chunks equals the same prompt in one step."""
    path = model_dir("llama", "mean")
    long_prompt = PROMPTS[2]
    chunked = vectors(pooling_llm(path).embed(long_prompt, use_tqdm=False))
    whole = vectors(pooling_llm(path, max_num_batched_tokens=128).embed(long_prompt, use_tqdm=False))
    np.testing.assert_allclose(chunked, whole, atol=1e-5, rtol=0)


def test_every_prompt_form_embeds_alike(model_dir):
    llm = pooling_llm(model_dir("qwen3", "last"))
    ids = llm.tokenizer.encode(PROMPTS[0])
    forms = [PROMPTS[0], {"prompt": PROMPTS[0]}, {"prompt_token_ids": ids}, ids]
    embedded = vectors(llm.embed(forms, use_tqdm=False))
    np.testing.assert_allclose(embedded, np.repeat(embedded[:1], len(forms), axis=0), atol=1e-6, rtol=0)


def test_normalize_false_returns_the_raw_pooled_state(model_dir):
    path = model_dir("qwen3", "last")
    output = pooling_llm(path).embed(PROMPTS[3], PoolingParams(normalize=False), use_tqdm=False)[0]
    expected = hf_embedding(path, output.prompt_token_ids, "last", normalize=False)
    np.testing.assert_allclose(output.outputs.embedding, expected, atol=1e-4, rtol=0)
    assert abs(np.linalg.norm(expected) - 1) > 0.1


def test_truncate_prompt_tokens_keeps_the_last_tokens(model_dir):
    llm = pooling_llm(model_dir("llama", "mean"))
    ids = llm.tokenizer.encode(PROMPTS[2])
    truncated = llm.embed(PROMPTS[2], truncate_prompt_tokens=5, use_tqdm=False)[0]
    assert truncated.prompt_token_ids == ids[-5:]
    np.testing.assert_allclose(
        truncated.outputs.embedding,
        llm.embed({"prompt_token_ids": ids[-5:]}, use_tqdm=False)[0].outputs.embedding,
    )


def test_matryoshka_dimensions_truncate_then_normalise(model_dir):
    path = model_dir("qwen3", "last", matryoshka_dimensions=(16, 32, 64))
    llm = pooling_llm(path)
    output = llm.embed(PROMPTS[0], PoolingParams(dimensions=16), use_tqdm=False)[0]
    assert len(output.outputs.embedding) == 16
    expected = hf_embedding(path, output.prompt_token_ids, "last", dimensions=16)
    np.testing.assert_allclose(output.outputs.embedding, expected, atol=1e-4, rtol=0)
    with pytest.raises(
        ValueError, match=r"dimensions must be one of the model's matryoshka dimensions \[16, 32, 64\]"
    ):
        llm.embed(PROMPTS[0], PoolingParams(dimensions=20), use_tqdm=False)
    assert_no_blocks_held(llm)


def test_dimensions_are_refused_by_a_model_without_matryoshka(model_dir):
    llm = pooling_llm(model_dir("qwen3", "last"))
    with pytest.raises(ValueError, match="dimensions: this model does not support matryoshka"):
        llm.embed(PROMPTS[0], PoolingParams(dimensions=16), use_tqdm=False)
    assert_no_blocks_held(llm)


def test_a_prompt_longer_than_max_model_len_is_refused_unless_truncated(model_dir):
    llm = pooling_llm(model_dir("llama", "last"))
    ids = list(range(10, 10 + 300))
    with pytest.raises(ValueError, match="max_model_len is 256"):
        llm.embed({"prompt_token_ids": ids}, use_tqdm=False)
    assert len(llm.embed([ids], truncate_prompt_tokens=-1, use_tqdm=False)[0].prompt_token_ids) == 256
    assert_no_blocks_held(llm)


def test_a_pooling_engine_refuses_generation_and_a_generation_engine_refuses_embed(model_dir, tiny_model_dir):
    with pytest.raises(ValueError, match="serves embeddings only"):
        pooling_llm(model_dir("llama", "last")).generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    generation = LLM(
        str(tiny_model_dir("llama")), enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=32
    )
    with pytest.raises(ValueError, match="LLM.embed needs a pooling model"):
        generation.embed("hi", use_tqdm=False)


def test_without_a_sentence_transformers_config_the_last_token_is_pooled_and_normalised(tiny_model_dir):
    """vLLM's default for convert="embed": a plain decoder checkpoint pools its last token, normalised."""
    from conftest import hf_model

    path = tiny_model_dir("llama")
    llm = pooling_llm(path)
    output = llm.embed(PROMPTS[0], use_tqdm=False)[0]
    import torch

    with torch.no_grad():
        hidden = (
            hf_model(path).model(torch.tensor([output.prompt_token_ids])).last_hidden_state[0, -1].numpy()
        )
    np.testing.assert_allclose(output.outputs.embedding, hidden / np.linalg.norm(hidden), atol=1e-4, rtol=0)


def test_the_default_model_embeds(default_gguf):
    llm = pooling_llm(default_gguf)
    batch = vectors(llm.embed(PROMPTS[:2], use_tqdm=False))
    assert batch.shape == (2, 576)
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(batch[1], vectors(llm.embed(PROMPTS[1], use_tqdm=False))[0], atol=1e-5)


def test_a_warmed_pooling_engine_compiles_nothing(model_dir):
    llm = LLM(str(model_dir("llama", "mean")), **ENGINE_ARGS)
    compiled = llm.metrics()["num_compilations"]
    llm.embed(PROMPTS, use_tqdm=False)
    llm.embed([p * 3 for p in PROMPTS] + ["x"], use_tqdm=False)
    llm.embed("y", use_tqdm=False)
    assert llm.metrics()["num_compilations"] == compiled
    assert_no_blocks_held(llm)


def test_a_prompt_recomputed_from_its_first_token_pools_afresh():
    """Recompute preemption restarts a prompt from token 0: its chunks' sums start again, not on top."""
    from jpaged.core.pooling import PooledPrompt

    rng = np.random.default_rng(0)
    tokens = rng.standard_normal((10, 4))
    pooled = PooledPrompt("mean", 10)
    pooled.add_chunk(0, 6, tokens[:6].sum(0))
    pooled.add_chunk(0, 4, tokens[:4].sum(0))  # preempted, then run again in other chunks
    pooled.add_chunk(4, 6, tokens[4:].sum(0))
    np.testing.assert_allclose(pooled.vector(normalize=False), tokens.mean(0), atol=1e-6)
    with pytest.raises(ValueError, match="must follow each other"):
        pooled.add_chunk(3, 1, tokens[3])


def test_runner_and_convert_are_checked_together():
    from jpaged.config import EngineConfig

    assert EngineConfig(convert="embed").is_pooling and EngineConfig(runner="pooling").is_pooling
    assert not EngineConfig().is_pooling
    with pytest.raises(ValueError, match="convert 'embed' makes a pooling model"):
        EngineConfig(runner="generate", convert="embed")
    with pytest.raises(ValueError, match="runner must be one of"):
        EngineConfig(runner="draft")


def test_jpaged_serve_takes_vllms_runner_and_convert_flags():
    from jpaged.entrypoints.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["serve", "some/model", "--runner", "pooling", "--convert", "embed"])
    config = engine_config_from_args(args)
    assert (config.runner, config.convert, config.is_pooling) == ("pooling", "embed", True)


def test_a_sentence_transformers_pooling_we_lack_is_refused_by_name(tmp_path):
    from jpaged.models.sentence_transformers_config import pooler_config_for

    (tmp_path / "modules.json").write_text(
        '[{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]'
    )
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_max_tokens": true}')
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        pooler_config_for(tmp_path)
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_cls_token": true}')
    assert pooler_config_for(tmp_path).pooling_type == "cls"
    assert not pooler_config_for(tmp_path).normalize  # no Normalize module


def test_poolings_of_one_model_config_never_share_compiled_programs(model_dir, tmp_path):
    """The executable cache keys a program by what it computes: a mean-pooling forward saved there must not
    answer for a CLS-pooling one over a model of the same config."""
    args = dict(ENGINE_ARGS, enforce_eager=True, compilation_cache_dir=str(tmp_path))
    for pooling in ("mean", "cls"):
        path = model_dir("llama", pooling)
        output = LLM(str(path), **args).embed(PROMPTS[3], use_tqdm=False)[0]
        expected = hf_embedding(path, output.prompt_token_ids, pooling)
        np.testing.assert_allclose(output.outputs.embedding, expected, atol=1e-4, rtol=0)
