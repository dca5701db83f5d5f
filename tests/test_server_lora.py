"""LoRA adapters served as models, as vLLM serves them: `--lora-modules` at start, a request's `model` naming an
adapter, /v1/models listing each with its parent, vLLM's load and unload routes when runtime updating is allowed,
and per-adapter metrics. Adapters are written by PEFT over the tiny Llama; each is held to transformers with the
adapter merged by PEFT."""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from conftest import hf_logits
from greedy import NEAR_TIE
from jpaged_server.api_server import build_app
from jpaged_server.cli import add_server_args, lora_modules
from jpaged_server.lora_adapters import LoRAModule
from peft_adapters import ALL_TARGETS, make_adapter
from server_harness import SMALL_ENGINE_ARGS, metric_samples, serve_in_thread

from jpaged.config import EngineConfig
from jpaged.engine.async_engine import AsyncLLMEngine

BASE = "tiny-llama"
PROMPT = "Hello there, how"
LORA_ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    """alpha and beta served from the start, gamma loaded at run time, wide over the engine's max_lora_rank."""
    root = tmp_path_factory.mktemp("server_adapters")
    specs = {
        "alpha": dict(rank=4, targets=("q_proj", "v_proj"), seed=11),
        "beta": dict(rank=8, targets=ALL_TARGETS, seed=12),
        "gamma": dict(rank=2, targets=("o_proj", "down_proj"), seed=13),
        "wide": dict(rank=16, targets=("q_proj",), seed=14),
    }
    return {name: make_adapter(tiny_llama_dir, root, name, **spec) for name, spec in specs.items()}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    engine = AsyncLLMEngine.from_config(
        EngineConfig(model=str(tiny_llama_dir), **SMALL_ENGINE_ARGS, **LORA_ENGINE)
    )
    yield engine
    engine.shutdown(timeout=5.0)


@pytest.fixture(scope="module")
def server(engine, adapters):
    modules = [
        LoRAModule("alpha", str(adapters["alpha"].path)),
        LoRAModule("beta", str(adapters["beta"].path), base_model_name="tiny-llama-base"),
    ]
    app = build_app(engine, BASE, lora_modules=modules, allow_runtime_lora_updating=True)
    with serve_in_thread(app) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def complete(client, model: str, prompt: str = PROMPT) -> tuple[list[int], list[int]]:
    """The greedy completion's prompt and generated token ids (EOS ignored, so every path is 8 tokens)."""
    response = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert response.model == model
    choice = response.choices[0].model_extra
    return choice["prompt_token_ids"], choice["token_ids"]


def assert_greedy_path(model_dir, prompt_ids: list[int], token_ids: list[int]) -> None:
    """Each token is transformers' argmax given the tokens before it, or within a near-tie of it."""
    logits = hf_logits(model_dir, prompt_ids + token_ids)[len(prompt_ids) - 1 : -1].astype(np.float64)
    logprobs = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    for step, token in enumerate(token_ids):
        assert logprobs[step].max() - logprobs[step, token] < NEAR_TIE, f"step {step} is not the argmax"


def load(server, name: str, path) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}
    )


def unload(server, name: str) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": name})


def lora_samples(server) -> dict[str, float]:
    """The LoRA samples of /metrics, keyed `name` or `name{adapter}`."""
    return metric_samples(server.base_url, "lora", "lora_name")


def test_models_lists_the_base_model_then_each_adapter_with_its_directory_and_parent(client, adapters):
    models = client.models.list().data
    assert [m.id for m in models] == [BASE, "alpha", "beta"]
    extras = [m.model_extra for m in models]
    assert [e["parent"] for e in extras] == [None, BASE, "tiny-llama-base"]
    assert [e["root"] for e in extras[1:]] == [str(adapters["alpha"].path), str(adapters["beta"].path)]
    assert all(m.object == "model" and m.owned_by == "jpaged" for m in models)


@pytest.mark.parametrize("name", ["alpha", "beta"])
def test_a_completion_naming_an_adapter_follows_transformers_with_the_adapter_merged(
    client, adapters, tiny_llama_dir, name
):
    prompt_ids, base_ids = complete(client, BASE)
    assert_greedy_path(tiny_llama_dir, prompt_ids, base_ids)
    _, adapter_ids = complete(client, name)
    assert_greedy_path(adapters[name].merged, prompt_ids, adapter_ids)
    assert adapter_ids != base_ids


def test_the_base_model_and_two_adapters_in_one_batch_answer_as_each_does_alone(client):
    alone = {model: complete(client, model) for model in (BASE, "alpha", "beta")}
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda model: (model, complete(client, model)), [BASE, "alpha", "beta"] * 2))
    assert all(answer == alone[model] for model, answer in together)


def test_chat_and_responses_serve_the_adapter_and_report_its_name(client):
    def chat(model):
        return client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    base, adapted = chat(BASE), chat("alpha")
    assert (base.model, adapted.model) == (BASE, "alpha")
    assert adapted.choices[0].message.content != base.choices[0].message.content
    streamed = client.chat.completions.create(
        model="alpha",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=6,
        temperature=0,
        stream=True,
    )
    assert {chunk.model for chunk in streamed} == {"alpha"}

    def respond(model):
        return client.responses.create(model=model, input=PROMPT, max_output_tokens=6, temperature=0)

    base, adapted = respond(BASE), respond("alpha")
    assert adapted.model == "alpha"
    assert adapted.output_text != base.output_text


def test_an_unknown_model_is_a_404_naming_the_served_ones(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="delta", prompt=PROMPT, max_tokens=2)
    error = caught.value.body
    assert error["param"] == "model"
    assert all(name in error["message"] for name in ("'delta'", BASE, "alpha", "beta"))


def test_an_adapter_loaded_at_run_time_serves_until_unloaded_then_its_name_is_a_404(server, client, adapters):
    answer = load(server, "gamma", adapters["gamma"].path)
    assert (answer.status_code, answer.text) == (200, "Success: LoRA adapter 'gamma' added successfully.")
    assert "gamma" in [m.id for m in client.models.list().data]
    prompt_ids, token_ids = complete(client, "gamma")
    assert_greedy_path(adapters["gamma"].merged, prompt_ids, token_ids)

    answer = unload(server, "gamma")
    assert (answer.status_code, answer.text) == (200, "Success: LoRA adapter 'gamma' removed successfully.")
    assert "gamma" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        complete(client, "gamma")
    assert unload(server, "gamma").status_code == 404


@pytest.mark.parametrize(
    ("name", "path_of", "param", "words"),
    [
        ("alpha", "alpha", "lora_name", ["'alpha'", "already been loaded"]),
        (BASE, "alpha", "lora_name", ["base model"]),
        ("nowhere", None, "lora_path", ["'nowhere'"]),
        ("wide", "wide", "lora_path", ["'wide'", "max_lora_rank"]),
    ],
    ids=["name taken", "the base model's name", "no adapter at the path", "rank over max_lora_rank"],
)
def test_loading_a_taken_name_or_a_bad_adapter_is_a_400_that_says_why(
    server, client, adapters, tmp_path, name, path_of, param, words
):
    path = adapters[path_of].path if path_of else tmp_path / "missing"
    answer = load(server, name, path)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert all(word in error["message"] for word in words), error["message"]
    assert [m.id for m in client.models.list().data] == [BASE, "alpha", "beta"]


def test_unloading_an_unknown_adapter_is_a_404(server):
    answer = unload(server, "delta")
    assert answer.status_code == 404
    assert answer.json()["error"]["param"] == "lora_name"


def test_without_runtime_updating_the_load_and_unload_routes_do_not_exist(engine, adapters):
    with serve_in_thread(build_app(engine, BASE)) as running:
        assert load(running, "gamma", adapters["gamma"].path).status_code == 404
        assert unload(running, "alpha").status_code == 404


def test_a_bad_adapter_in_lora_modules_stops_the_app_from_starting(engine, tmp_path):
    # The engine holds alpha and beta already (ids 1 and 2): the new app's id for "broken" must pass them.
    with pytest.raises(ValueError, match="LoRA adapter 'broken' at"):
        build_app(engine, BASE, lora_modules=[LoRAModule("broken", str(tmp_path / "missing"))])


def test_metrics_count_requests_per_adapter_and_show_the_slots(server, client):
    before = lora_samples(server)
    for model in ("alpha", "alpha", "beta", BASE):
        complete(client, model)
    after = lora_samples(server)
    counted = {
        name: after[f"jpaged:lora_requests_total{{{name}}}"]
        - before.get(f"jpaged:lora_requests_total{{{name}}}", 0)
        for name in ("alpha", "beta")
    }
    assert counted == {"alpha": 2, "beta": 1}
    assert after["jpaged:lora_slots"] == LORA_ENGINE["max_loras"]
    assert after["jpaged:lora_slots_in_use"] == 0  # nothing runs between requests
    assert 1 <= after["jpaged:lora_slots_filled"] <= LORA_ENGINE["max_loras"]
    assert after["jpaged:lora_slot_loads_total"] >= 2


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return parser.parse_args(argv)


def test_lora_modules_take_vllms_name_path_and_json_forms_after_one_flag():
    args = parse("--lora-modules", "a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}')
    assert args.lora_modules == [LoRAModule("a", "/x"), LoRAModule("b", "/y", "m")]


@pytest.mark.parametrize(
    "item", ["a", "=/x", "a=", '{"name": "b"}', '{"name": "b", "path": "/y", "x": 1}', "{"]
)
def test_a_malformed_lora_module_is_a_usage_error(item, capsys):
    with pytest.raises(SystemExit):
        parse("--lora-modules", item)
    assert "--lora-modules" in capsys.readouterr().err


def test_lora_modules_without_enable_lora_is_an_error_that_names_the_flag():
    args = parse("--lora-modules", "a=/x")
    with pytest.raises(ValueError, match="--enable-lora"):
        lora_modules(args, EngineConfig())
    assert lora_modules(args, EngineConfig(enable_lora=True)) == [LoRAModule("a", "/x")]


@pytest.mark.parametrize(("value", "allowed"), [("1", True), ("true", True), ("True", True), ("0", False)])
def test_runtime_updating_is_allowed_by_the_flag_or_vllms_variable(monkeypatch, value, allowed):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert parse().allow_runtime_lora_updating is False
    assert parse("--allow-runtime-lora-updating").allow_runtime_lora_updating is True
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
    assert parse().allow_runtime_lora_updating is allowed
