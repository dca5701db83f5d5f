"""The OpenAI-compatible API through the official `openai` client, against a real uvicorn server and tiny model."""

from __future__ import annotations

import httpx
import openai
import pytest
from jpaged_server.api_server import build_app
from prometheus_client.parser import text_string_to_metric_families
from server_harness import serve_in_thread

MODEL = "tiny-smollm2"
PROMPT = "Hello there, how"  # a few tokens: prefill and decode share the smallest step shape


@pytest.fixture(scope="module")
def server(engine):
    with serve_in_thread(build_app(engine, MODEL)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def greedy(client, **kwargs):
    return client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, **kwargs)


def test_models_lists_the_served_name_with_its_context_length(client, engine):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == engine.engine.max_model_len


def test_completion_returns_max_tokens_tokens_and_usage(client, server):
    response = greedy(client, max_tokens=6)
    (choice,) = response.choices
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 6
    prompt_ids = httpx.post(f"{server.base_url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.total_tokens == len(prompt_ids) + 6
    assert greedy(client, max_tokens=6).choices[0].text == choice.text  # greedy is deterministic


def test_token_id_prompt_completes_like_its_text(client, server):
    ids = httpx.post(f"{server.base_url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=6)
    assert by_ids.choices[0].text == greedy(client, max_tokens=6).choices[0].text


def test_several_prompts_get_one_choice_each_in_order(client):
    prompts = [PROMPT, "One two three"]
    response = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=4)
    assert [c.index for c in response.choices] == [0, 1]
    for prompt, choice in zip(prompts, response.choices, strict=True):
        single = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=4)
        assert choice.text == single.choices[0].text
    assert response.usage.completion_tokens == 8


def test_streamed_completion_concatenates_to_the_whole_one(client):
    whole = greedy(client, max_tokens=8)
    chunks = list(greedy(client, max_tokens=8, stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_stop_string_ends_the_text_before_it(client):
    full = greedy(client, max_tokens=12).choices[0].text
    stop = full[len(full) // 2 :][:3]
    assert stop.strip(), f"need a visible stop string, the greedy text was {full!r}"
    cut = greedy(client, max_tokens=12, stop=[stop])
    choice = cut.choices[0]
    assert choice.text == full[: full.index(stop)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    streamed = "".join(c.choices[0].text for c in greedy(client, max_tokens=12, stop=[stop], stream=True))
    assert streamed == choice.text


def test_two_samples_per_prompt_are_two_choices(client):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, n=2, seed=7, max_tokens=5, temperature=1.0
    )
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert response.usage.completion_tokens == 10
    again = client.completions.create(model=MODEL, prompt=PROMPT, n=2, seed=7, max_tokens=5, temperature=1.0)
    assert [c.text for c in again.choices] == [c.text for c in response.choices]  # seeded: reproducible


def test_completion_logprobs_cover_every_token_with_offsets(client):
    choice = greedy(client, max_tokens=5, logprobs=2).choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    for token, value, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert value <= 0
        assert top[token] == value  # greedy: the sampled token is the most likely one
        assert len(top) == 2 and max(top.values()) == value
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]


def test_echo_prepends_the_prompt(client):
    plain = greedy(client, max_tokens=4).choices[0].text
    assert greedy(client, max_tokens=4, echo=True).choices[0].text == PROMPT + plain


def test_echo_with_logprobs_covers_the_prompt_tokens_then_the_completion(client):
    plain = greedy(client, max_tokens=3, logprobs=2).choices[0]
    echoed = greedy(client, max_tokens=3, logprobs=2, echo=True).choices[0]
    num_prompt = len(echoed.logprobs.tokens) - 3
    assert num_prompt > 1
    assert echoed.logprobs.token_logprobs[0] is None and echoed.logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in echoed.logprobs.token_logprobs[1:])
    assert echoed.logprobs.token_logprobs[num_prompt:] == plain.logprobs.token_logprobs
    assert echoed.logprobs.text_offset[num_prompt] == len(PROMPT)
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True, stream=True
    )
    tokens = [t for chunk in streamed for t in (chunk.choices[0].logprobs.tokens if chunk.choices else [])]
    assert tokens == echoed.logprobs.tokens


def test_streamed_choices_join_to_the_whole_response_with_the_same_offsets_and_usage(client):
    """The stream's chunks carry only what is new; joined per choice they are the whole response, text offsets
    counting from the start of each choice's text."""
    asked = dict(max_tokens=7, temperature=1.0, seed=11, n=2, logprobs=1, echo=True)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, **asked)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **asked
        )
    )
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [t for c in mine for t in c.logprobs.tokens] == choice.logprobs.tokens
        assert [o for c in mine for o in c.logprobs.text_offset] == choice.logprobs.text_offset
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
    streamed = chunks[-1].usage
    assert (streamed.prompt_tokens, streamed.completion_tokens, streamed.total_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
        whole.usage.total_tokens,
    )


def test_chat_whole_and_streamed_agree(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=6)
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_completion_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    streamed = chunks[-1].usage
    assert (streamed.prompt_tokens, streamed.completion_tokens) == (whole.usage.prompt_tokens, 6)
    # The second request found the first one's full prompt blocks in the prefix cache.
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < streamed.prompt_tokens_details.cached_tokens < streamed.prompt_tokens


def test_chat_top_logprobs_are_sorted_and_include_the_greedy_token(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=3, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    content = response.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 2 and values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token and entry.bytes == list(entry.token.encode())


def test_tokenize_and_detokenize_round_trip(server):
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == PROMPT
    chat = httpx.post(
        f"{server.base_url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}
    ).json()
    assert chat["count"] > tokens["count"]  # the template adds its role markers


def test_health_and_version(server):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json()["version"]


def _scrape(server) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def test_metrics_parse_and_count_a_finished_request(client, server):
    before = _scrape(server)
    response = greedy(client, max_tokens=5)
    after = _scrape(server)

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert moved("jpaged:prompt_tokens_total{}") == response.usage.prompt_tokens
    assert moved("jpaged:generation_tokens_total{}") == 5
    assert moved("jpaged:request_success_total{finished_reason=length}") == 1
    assert moved("jpaged:time_to_first_token_seconds_count{}") == 1
    assert moved("jpaged:e2e_request_latency_seconds_count{}") == 1
    assert moved("jpaged:inter_token_latency_seconds_count{}") == 4
    assert after["jpaged:num_requests_running{}"] == 0 and after["jpaged:kv_cache_usage_perc{}"] == 0
    for name in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_compilations"):
        assert f"jpaged:{name}_total{{}}" in after


def test_metrics_count_every_choice_and_token_of_a_stream(client, server):
    before = _scrape(server)
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, n=2, seed=3, stream=True)
    )
    after = _scrape(server)
    assert {c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason} == {"length"}
    moved = {name: after[name] - before.get(name, 0.0) for name in after}
    assert moved["jpaged:request_success_total{finished_reason=length}"] == 2
    assert moved["jpaged:time_to_first_token_seconds_count{}"] == 1
    assert moved["jpaged:inter_token_latency_seconds_count{}"] == 4  # the two samples step together
    assert moved["jpaged:generation_tokens_total{}"] == 10
