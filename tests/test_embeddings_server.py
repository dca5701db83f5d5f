"""POST /v1/embeddings on a pooling server (`--runner pooling --convert embed`), in OpenAI's shape: every input form,
float and base64 (little-endian float32) alike, `dimensions` where the model is Matryoshka, usage, bad input a 400
naming the field; a pooling server refuses the generation APIs and a generation server refuses embeddings."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from embedding_models import hf_embedding, save_embedding_model
from server_harness import SMALL_ENGINE_ARGS, http_client, shared_engine, small_engine

from jpaged.config import EngineConfig

TEXTS = ["The quick brown fox", "Embeddings map text to vectors, " * 6]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, default_tokenizer):
    root = str(tmp_path_factory.mktemp("embedding_server"))
    return save_embedding_model(
        root, "qwen3", "last", matryoshka_dimensions=(16, 32, 64), tokenizer=default_tokenizer
    )


@pytest.fixture(scope="module")
def engine(model_path):
    return shared_engine(
        EngineConfig(model=str(model_path), runner="pooling", convert="embed", **SMALL_ENGINE_ARGS)
    )


def embed(http, **body):
    return http.post("/v1/embeddings", json={"model": "tiny", **body})


def vectors(response) -> np.ndarray:
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    assert all(d["object"] == "embedding" for d in data)
    return np.array([d["embedding"] for d in data])


def test_embeddings_equal_transformers_in_openais_shape(http, model_path, default_tokenizer):
    response = embed(http, input=TEXTS)
    body = response.json()
    assert body["object"] == "list" and body["model"] == "tiny" and body["id"].startswith("embd-")
    ids = [default_tokenizer.encode(text) for text in TEXTS]
    num_tokens = sum(map(len, ids))
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    expected = np.array([hf_embedding(model_path, i, "last") for i in ids])
    np.testing.assert_allclose(vectors(response), expected, atol=1e-4, rtol=0)


def test_every_input_form_gives_the_same_vectors(http, default_tokenizer):
    ids = [default_tokenizer.encode(text) for text in TEXTS]
    batch = vectors(embed(http, input=TEXTS))
    np.testing.assert_allclose(vectors(embed(http, input=TEXTS[0])), batch[:1], atol=1e-6)
    np.testing.assert_allclose(vectors(embed(http, input=ids[1])), batch[1:], atol=1e-6)
    np.testing.assert_allclose(vectors(embed(http, input=ids)), batch, atol=1e-6)


def test_base64_decodes_to_the_float_vectors(http):
    floats = vectors(embed(http, input=TEXTS, encoding_format="float"))
    response = embed(http, input=TEXTS, encoding_format="base64")
    assert response.status_code == 200, response.text
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in response.json()["data"]]
    np.testing.assert_array_equal(np.array(decoded), floats.astype(np.float32))


def test_dimensions_truncate_a_matryoshka_model_then_normalise(http, model_path, default_tokenizer):
    truncated = vectors(embed(http, input=TEXTS[0], dimensions=16))
    assert truncated.shape == (1, 16)
    expected = hf_embedding(model_path, default_tokenizer.encode(TEXTS[0]), "last", dimensions=16)
    np.testing.assert_allclose(truncated[0], expected, atol=1e-4, rtol=0)


def test_vllm_extras_normalize_and_truncate_prompt_tokens(http, default_tokenizer):
    raw = vectors(embed(http, input=TEXTS[1], normalize=False))[0]
    assert abs(np.linalg.norm(raw) - 1) > 0.1
    ids = default_tokenizer.encode(TEXTS[1])
    response = embed(http, input=TEXTS[1], truncate_prompt_tokens=4)
    assert response.json()["usage"]["prompt_tokens"] == 4
    np.testing.assert_allclose(vectors(response), vectors(embed(http, input=ids[-4:])), atol=1e-6)


def test_unknown_fields_are_ignored(http):
    np.testing.assert_allclose(
        vectors(embed(http, input=TEXTS[0], foo="bar", user="u1")), vectors(embed(http, input=TEXTS[0]))
    )


@pytest.mark.parametrize(
    "body, param",
    [
        (dict(input=[]), "input"),
        (dict(input=""), "input"),
        (dict(input=[1.5, 2]), "input"),
        (dict(input=["ok", 3]), "input"),
        (dict(input=list(range(300))), "input"),
        (dict(input=[[1, 2], [10**9]]), "input"),
        (dict(), "input"),
        (dict(input="hi", dimensions=20), "dimensions"),
        (dict(input="hi", dimensions=0), "dimensions"),
        (dict(input="hi", encoding_format="int8"), "encoding_format"),
        (dict(input="hi", truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(http, engine, body, param):
    response = embed(http, **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    blocks = engine.engine.blocks
    assert blocks.num_free_blocks == blocks.num_total_blocks


def test_an_unknown_model_is_a_404(http):
    assert http.post("/v1/embeddings", json={"model": "other", "input": "hi"}).status_code == 404


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_pooling_server_refuses_generation(http, path):
    body = {"model": "tiny", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = http.post(path, json=body)
    assert response.status_code == 400
    assert "does not support" in response.json()["error"]["message"]


def test_a_generation_server_refuses_embeddings(tiny_model_dir):
    with http_client(small_engine(tiny_model_dir)) as client:
        response = client.post("/v1/embeddings", json={"model": "tiny", "input": "hi"})
    assert response.status_code == 400
    assert "does not support the Embeddings API" in response.json()["error"]["message"]


def test_concurrent_requests_share_steps_and_equal_their_answers_alone(http, engine):
    from concurrent.futures import ThreadPoolExecutor

    inputs = [f"request {i}: " + TEXTS[i % 2] * (1 + i % 3) for i in range(12)]
    alone = [vectors(embed(http, input=text))[0] for text in inputs]
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda text: vectors(embed(http, input=text))[0], inputs))
    np.testing.assert_allclose(np.array(together), np.array(alone), atol=1e-5, rtol=0)
    blocks = engine.engine.blocks
    assert blocks.num_free_blocks == blocks.num_total_blocks
    assert http.get("/metrics").status_code == 200
