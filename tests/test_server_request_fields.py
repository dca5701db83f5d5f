"""What a client written for vLLM sends, served: unknown fields ignored and named in a header (refused with
--strict-request-fields), nulls as defaults, output-changing fields we lack refused, and vLLM's request extras
(return_token_ids, prompt_logprobs, truncate_prompt_tokens, continue_final_message, chat echo, bad_words,
allowed_token_ids, request_id, best_of, legacy functions, continuous usage stats) doing what vLLM's do."""

from __future__ import annotations

import json
import logging

import httpx
import jsonschema
import pytest
from jpaged_server.api_server import build_app
from jpaged_server.request_fields import IGNORED_FIELDS_HEADER, UNSUPPORTED
from server_harness import assert_400, serve_in_thread

HI = [{"role": "user", "content": "Hi"}]
POINT = {"type": "object", "properties": {"x": {"type": "boolean"}, "y": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def strict_http(engine):
    with (
        serve_in_thread(build_app(engine, "tiny", strict_request_fields=True)) as running,
        httpx.Client(base_url=running.base_url, timeout=120) as client,
    ):
        yield client


def chat(http: httpx.Client, **body) -> dict:
    response = http.post(
        "/v1/chat/completions", json={"messages": HI, "max_tokens": 4, "temperature": 0, **body}
    )
    assert response.status_code == 200, response.text
    return response.json()


def complete(http: httpx.Client, **body) -> dict:
    response = http.post(
        "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0, **body}
    )
    assert response.status_code == 200, response.text
    return response.json()


def stream_chunks(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        payloads = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


# ---- fields the server does not declare ----


def test_an_unknown_field_is_ignored_logged_once_and_named_in_a_header(http, caplog):
    body = {"messages": HI, "max_tokens": 2, "temperature": 0}
    plain = http.post("/v1/chat/completions", json=body)
    with caplog.at_level(logging.WARNING, logger="jpaged_server.request_fields"):
        sent = [
            http.post("/v1/chat/completions", json={**body, "frobnicate": 1, "stream_options": None})
            for _ in range(2)
        ]
    assert [r.status_code for r in sent] == [200, 200]
    assert sent[0].headers[IGNORED_FIELDS_HEADER] == "frobnicate"
    assert IGNORED_FIELDS_HEADER not in plain.headers
    assert sent[0].json()["choices"] == plain.json()["choices"]
    assert sum("frobnicate" in record.getMessage() for record in caplog.records) <= 1


def test_fields_that_change_nothing_here_are_accepted_and_named(http):
    fields = {
        "store": True,
        "metadata": {"k": "v"},
        "service_tier": "auto",
        "verbosity": "low",
        "prompt_cache_key": "k",
        "safety_identifier": "u",
        "user": "u",
        "vllm_xargs": {"a": 1},
        "spaces_between_special_tokens": False,
    }
    response = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1, **fields})
    assert response.status_code == 200, response.text
    assert set(response.headers[IGNORED_FIELDS_HEADER].split(", ")) == set(fields)


def test_nested_unknown_fields_are_named_by_their_path(http):
    body = {"messages": [{"role": "user", "content": "Hi", "weight": 1}], "max_tokens": 1}
    body["stream_options"] = {"include_usage": True, "extra": 1}
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        response.read()
    assert response.status_code == 200
    assert response.headers[IGNORED_FIELDS_HEADER] == "stream_options.extra, messages[].weight"


def test_any_field_name_is_named_in_printable_ascii_and_the_list_is_bounded(http):
    body = {"prompt": "x", "max_tokens": 1, "Ā\r\n": 1, "": 1, " ": 1, **{f"f{i}": i for i in range(40)}}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    names = response.headers[IGNORED_FIELDS_HEADER].split(", ")
    assert names[:3] == ["\\u0100\\r\\n", '""', "\\x20"] and names[-1] == "... (11 more)" and len(names) == 33


@pytest.mark.parametrize("field", ["suffix", "audio", "chat_template"])
def test_a_field_that_would_change_the_output_and_is_not_served_is_400(http, field):
    path, body = (
        ("/v1/completions", {"prompt": "x"})
        if field == "suffix"
        else ("/v1/chat/completions", {"messages": HI})
    )
    response = http.post(path, json={**body, field: "y"})
    assert_400(response, field)
    assert UNSUPPORTED[field] in response.json()["error"]["message"]


def test_strict_request_fields_refuses_unknown_fields_but_not_known_ones(strict_http):
    assert_400(strict_http.post("/v1/completions", json={"prompt": "x", "frobnicate": 1}), "frobnicate")
    accepted = strict_http.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 1, "user": "u", "stream": None}
    )
    assert accepted.status_code == 200, accepted.text


def test_null_means_the_default_where_openai_allows_it(http):
    nulls = {
        "stream": None,
        "logprobs": None,
        "echo": None,
        "n": None,
        "stream_options": None,
        "best_of": None,
    }
    assert complete(http, **nulls)["choices"] == complete(http)["choices"]
    chat_nulls = {"logprobs": None, "parallel_tool_calls": None, "stream": None, "top_logprobs": None}
    assert chat(http, **chat_nulls)["choices"] == chat(http)["choices"]
    assert_400(http.post("/v1/chat/completions", json={"messages": None}), "messages")


def test_ping_answers_like_health_without_an_api_key(engine):
    with serve_in_thread(build_app(engine, "tiny", api_key="secret")) as running:
        assert httpx.get(f"{running.base_url}/ping").status_code == 200
        assert httpx.post(f"{running.base_url}/ping").status_code == 200


# ---- vLLM's request extras ----


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(http):
    options = {"include_usage": True, "continuous_usage_stats": True}
    for path, body in (("/v1/completions", {"prompt": "Hello"}), ("/v1/chat/completions", {"messages": HI})):
        chunks = stream_chunks(
            http, path, {**body, "max_tokens": 5, "ignore_eos": True, "stream_options": options}
        )
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert all(c["usage"] for c in chunks) and counts == sorted(counts) and counts[-1] == 5


def test_return_token_ids_gives_the_prompt_and_output_ids(http):
    whole = chat(http, return_token_ids=True)
    prompt_ids = http.post("/tokenize", json={"messages": HI}).json()["tokens"]
    assert whole["prompt_token_ids"] == prompt_ids
    (choice,) = whole["choices"]
    assert (
        http.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"]
        == choice["message"]["content"]
    )
    chunks = stream_chunks(
        http,
        "/v1/chat/completions",
        {"messages": HI, "max_tokens": 4, "temperature": 0, "return_token_ids": True},
    )
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == choice["token_ids"]
    (completion,) = complete(http, return_token_ids=True)["choices"]
    assert completion["prompt_token_ids"] == http.post("/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    assert len(completion["token_ids"]) == 4
    assert "token_ids" not in chat(http)["choices"][0]


def test_chat_prompt_logprobs_cover_the_prompt_and_are_refused_on_a_stream(http):
    whole = chat(http, prompt_logprobs=1, return_token_ids=True)
    entries = whole["prompt_logprobs"]
    assert len(entries) == len(whole["prompt_token_ids"]) and entries[0] is None
    for token_id, entry in zip(whole["prompt_token_ids"][1:], entries[1:], strict=True):
        assert str(token_id) in entry and all(e["logprob"] <= 0 for e in entry.values())
    (choice,) = complete(http, prompt_logprobs=0)["choices"]
    assert choice["prompt_logprobs"][0] is None
    stream = http.post("/v1/chat/completions", json={"messages": HI, "stream": True, "prompt_logprobs": 1})
    assert_400(stream, "prompt_logprobs")


def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens(http):
    ids = http.post("/tokenize", json={"prompt": "one two three four five six"}).json()["tokens"]
    cut = complete(
        http, prompt="one two three four five six", truncate_prompt_tokens=3, return_token_ids=True
    )
    assert cut["usage"]["prompt_tokens"] == 3
    assert cut["choices"][0]["prompt_token_ids"] == ids[-3:]
    assert cut["choices"][0]["text"] == complete(http, prompt=ids[-3:])["choices"][0]["text"]
    assert_400(
        http.post("/v1/completions", json={"prompt": "x", "truncate_prompt_tokens": 10_000}),
        "truncate_prompt_tokens",
    )


def test_continue_final_message_continues_the_assistant_s_text(http, default_tokenizer):
    messages = [*HI, {"role": "assistant", "content": "The answer is"}]
    whole = chat(
        http,
        messages=messages,
        add_generation_prompt=False,
        continue_final_message=True,
        return_token_ids=True,
    )
    expected = default_tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert whole["prompt_token_ids"] == default_tokenizer.encode(expected, add_special_tokens=False)
    assert default_tokenizer.decode(whole["prompt_token_ids"]).endswith("The answer is")
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    assert (
        http.post("/tokenize", json={"messages": messages, **flags}).json()["tokens"]
        == whole["prompt_token_ids"]
    )
    both = http.post("/v1/chat/completions", json={"messages": messages, "continue_final_message": True})
    assert_400(both, "continue_final_message")


def test_chat_echo_starts_the_reply_with_the_assistant_s_last_message(http):
    messages = [*HI, {"role": "assistant", "content": "The answer is"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    echoed = chat(http, echo=True, **body)["choices"][0]["message"]["content"]
    plain = chat(http, **body)["choices"][0]["message"]["content"]
    assert echoed == "The answer is" + plain
    chunks = stream_chunks(
        http, "/v1/chat/completions", {**body, "echo": True, "max_tokens": 4, "temperature": 0}
    )
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == echoed
    assert (
        chat(http, echo=True)["choices"][0]["message"]["content"]
        == chat(http)["choices"][0]["message"]["content"]
    )


def test_add_special_tokens_on_chat_adds_the_tokenizer_s_own(http, default_tokenizer):
    text = default_tokenizer.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)
    with_special = chat(http, add_special_tokens=True, return_token_ids=True)["prompt_token_ids"]
    assert with_special == default_tokenizer.encode(text, add_special_tokens=True)


def test_allowed_token_ids_and_bad_words_constrain_the_sampled_tokens(http):
    allowed = [1000, 2000, 3000]
    (choice,) = complete(http, allowed_token_ids=allowed, max_tokens=6, return_token_ids=True)["choices"]
    assert set(choice["token_ids"]) <= set(allowed)
    first = complete(http, return_token_ids=True)["choices"][0]
    word = http.post("/detokenize", json={"tokens": first["token_ids"][:1]}).json()["prompt"].strip()
    banned = complete(http, bad_words=[word], return_token_ids=True)["choices"][0]
    assert banned["token_ids"][0] != first["token_ids"][0]


def test_request_id_names_the_response_and_the_header_wins(http):
    assert chat(http, request_id="abc")["id"] == "chatcmpl-abc"
    assert complete(http, request_id="abc")["id"] == "cmpl-abc"
    response = http.post(
        "/v1/completions",
        json={"prompt": "x", "max_tokens": 1, "request_id": "abc"},
        headers={"X-Request-Id": "hdr"},
    )
    assert response.json()["id"] == "cmpl-hdr"


def test_best_of_returns_the_sample_of_highest_cumulative_logprob(http):
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    samples = complete(http, **body, n=3, logprobs=0)
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in samples["choices"]]
    best = complete(http, **body, n=1, best_of=3)
    assert [c["text"] for c in best["choices"]] == [samples["choices"][sums.index(max(sums))]["text"]]
    assert best["choices"][0]["logprobs"] is None
    assert best["usage"]["completion_tokens"] == 12
    assert_400(http.post("/v1/completions", json={"prompt": "x", "n": 2, "best_of": 1}), "best_of")
    assert_400(http.post("/v1/completions", json={"prompt": "x", "best_of": 2, "stream": True}), "best_of")


def test_legacy_functions_answer_with_a_function_call(http):
    functions = [{"name": "locate", "parameters": POINT}]
    whole = chat(http, functions=functions, function_call={"name": "locate"}, max_tokens=40)
    message = whole["choices"][0]["message"]
    assert message["function_call"]["name"] == "locate" and "tool_calls" not in message
    jsonschema.validate(json.loads(message["function_call"]["arguments"]), POINT)
    assert whole["choices"][0]["finish_reason"] == "function_call"
    chunks = stream_chunks(
        http,
        "/v1/chat/completions",
        {
            "messages": HI,
            "functions": functions,
            "function_call": {"name": "locate"},
            "max_tokens": 40,
            "temperature": 0,
        },
    )
    pieces = [
        c["choices"][0]["delta"]["function_call"]
        for c in chunks
        if "function_call" in c["choices"][0]["delta"]
    ]
    assert pieces[0]["name"] == "locate"
    assert "".join(p.get("arguments", "") for p in pieces) == message["function_call"]["arguments"]
    follow_up = [
        *HI,
        {"role": "assistant", "content": None, "function_call": message["function_call"]},
        {"role": "function", "name": "locate", "content": "{}"},
    ]
    assert chat(http, messages=follow_up)["choices"][0]["finish_reason"] in ("stop", "length")


# ---- structured outputs and tool calls ----


def test_json_object_with_a_schema_follows_the_schema(http):
    fmt = {"type": "json_object", "schema": {**POINT, "required": ["x", "y"]}}
    content = chat(http, response_format=fmt, max_tokens=40)["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), fmt["schema"])


@pytest.mark.parametrize(
    "field",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": POINT}}},
        {"structured_outputs": {"json": POINT}},
        {"guided_json": POINT},
    ],
    ids=["response_format", "structured_outputs", "guided_json"],
)
def test_a_schema_generates_only_the_properties_it_declares(http, field):
    for seed in range(3):
        content = chat(http, **field, max_tokens=60, temperature=1.0, seed=seed)["choices"][0]["message"][
            "content"
        ]
        assert set(json.loads(content)) <= {"x", "y"}, content


def test_a_forced_tool_call_cut_by_max_tokens_is_still_a_tool_call(http):
    tools = [{"type": "function", "function": {"name": "locate", "parameters": POINT}}]
    whole = chat(
        http, tools=tools, tool_choice={"type": "function", "function": {"name": "locate"}}, max_tokens=3
    )
    (choice,) = whole["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "locate" and call["function"]["arguments"].startswith("{")
    required = chat(http, tools=tools, tool_choice="required", max_tokens=12)["choices"][0]
    assert required["finish_reason"] == "length" and required["message"]["content"] is None


def test_a_forced_tool_call_wins_over_response_format_as_in_vllm(http):
    tools = [{"type": "function", "function": {"name": "locate", "parameters": POINT}}]
    fmt = {"type": "json_schema", "json_schema": {"name": "other", "schema": {"type": "array"}}}
    whole = chat(http, tools=tools, tool_choice="required", response_format=fmt, max_tokens=60)
    (call,) = whole["choices"][0]["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), POINT)


def test_streamed_tool_calls_carry_one_entry_per_call_and_no_empty_deltas(http):
    tools = [{"type": "function", "function": {"name": "locate", "parameters": POINT}}]
    body = {"messages": HI, "tools": tools, "tool_choice": "required", "max_tokens": 60, "temperature": 0}
    chunks = stream_chunks(http, "/v1/chat/completions", body)
    for chunk in chunks:
        (choice,) = chunk["choices"]
        assert choice["delta"] or choice["finish_reason"], chunk
        indices = [call["index"] for call in choice["delta"].get("tool_calls", [])]
        assert len(indices) == len(set(indices)), chunk
    calls = [call for c in chunks for call in c["choices"][0]["delta"].get("tool_calls", [])]
    assert "id" in calls[0] and calls[0]["function"]["name"] == "locate"
    arguments = "".join(call["function"].get("arguments", "") for call in calls if call["index"] == 0)
    jsonschema.validate(json.loads(arguments), POINT)  # no piece (the opening "{" included) was lost
