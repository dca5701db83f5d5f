"""The server's harmony path over HTTP, with the engine replaced by one that replies with harmony tokens written by
openai_harmony: a gpt-oss model's requests are rendered by harmony (prompt ids, stop tokens) and its replies read
back as reasoning, content and tool calls on /v1/chat/completions (whole and streamed) and /v1/responses."""

from __future__ import annotations

import collections
import json
from types import SimpleNamespace

import pytest
from jpaged_server.api_server import build_app
from jpaged_server.harmony import HarmonyChat
from jpaged_server.protocol import ChatCompletionRequest
from openai_harmony import Message, Role
from server_harness import assert_400, http_client

from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.sampling_params import RequestOutputKind

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
BODY = {
    "messages": [
        {"role": "system", "content": "Answer in one sentence."},
        {"role": "user", "content": "Weather in Oslo?"},
    ],
    "tools": [WEATHER],
    "reasoning_effort": "low",
}


class ScriptedEngine:
    """The AsyncLLMEngine surface the server reads, replying to every request with `reply` (token ids) one token
    a step; what it was asked is kept in `asked`."""

    def __init__(self, reply: list[int], architecture: str = "gpt_oss") -> None:
        self.reply = reply
        self.asked: list[tuple[list[int], object]] = []
        checks = SimpleNamespace(check_prompt=lambda ids: None, check_params=lambda params: None)
        self.engine = SimpleNamespace(
            model_config=SimpleNamespace(architecture=architecture, vocab_size=201088),
            config=SimpleNamespace(is_pooling=False, max_num_seqs=8),
            max_model_len=4096,
            checks=checks,
            tokenizer=SimpleNamespace(encode=lambda text, add_special_tokens=False: list(text.encode())),
        )
        self.is_alive, self.num_unfinished, self.failure = True, 0, None

    def metrics(self) -> dict:
        return collections.defaultdict(float)

    async def generate(self, prompt_ids, params, request_id, priority=0, cache_salt=None):
        self.asked.append((list(prompt_ids), params))
        tokens = self.reply[: params.max_tokens]
        finish = "length" if len(tokens) < len(self.reply) else "stop"
        stop = tokens[-1] if finish == "stop" and tokens[-1] in (params.stop_token_ids or ()) else None

        def output(ids: list[int], done: bool) -> RequestOutput:
            choice = CompletionOutput(0, "", ids, finish_reason=finish if done else None)
            choice.stop_reason = stop if done else None
            return RequestOutput(request_id, None, list(prompt_ids), [choice], finished=done)

        if params.output_kind == RequestOutputKind.DELTA:
            for i, token in enumerate(tokens):
                yield output([token], i == len(tokens) - 1)
        else:
            yield output(tokens, True)


@pytest.fixture(scope="module")
def chat() -> HarmonyChat:
    return HarmonyChat.load()


def completion(chat: HarmonyChat, *messages: Message) -> list[int]:
    ids = [token for message in messages for token in chat.encoding.render(message)]
    return ids[2:]  # after the prompt's <|start|>assistant


def assistant(channel: str, text: str, to: str | None = None) -> Message:
    message = Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)
    return message.with_recipient(to).with_content_type("<|constrain|>json") if to else message


@pytest.fixture(scope="module")
def calls(chat) -> list[int]:
    thinking = assistant("analysis", "Need the weather tool.")
    return completion(chat, thinking, assistant("commentary", '{"city": "Oslo"}', to="functions.get_weather"))


def test_a_tool_call_comes_back_as_tool_calls_with_the_reasoning(chat, calls):
    engine = ScriptedEngine(calls)
    with http_client(engine) as client:
        response = client.post("/v1/chat/completions", json=BODY)
    assert response.status_code == 200, response.text
    [(prompt_ids, params)] = engine.asked
    assert prompt_ids == chat.prompt(ChatCompletionRequest.model_validate(BODY)).ids
    assert "Reasoning: low" in chat.encoding.decode(prompt_ids)
    assert set(chat.encoding.stop_tokens_for_assistant_actions()) <= set(params.stop_token_ids)
    [choice] = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == message["reasoning"] == "Need the weather tool."
    assert message["content"] is None
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_a_streamed_reply_sends_the_same_in_deltas(calls):
    with http_client(ScriptedEngine(calls)) as client:
        whole = client.post("/v1/chat/completions", json=BODY).json()["choices"][0]["message"]
        with client.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as response:
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line)["choices"][0] for line in lines[:-1]]
    deltas = [c["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole["reasoning_content"]
    assert not any(d.get("content") for d in deltas)
    pieces = [p for d in deltas for p in d.get("tool_calls", [])]
    assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["id"].startswith("call_")
    assert (
        "".join(p["function"].get("arguments", "") for p in pieces)
        == whole["tool_calls"][0]["function"]["arguments"]
    )
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_an_answer_is_the_content_and_stops(chat):
    reply = completion(chat, assistant("analysis", "Easy."), assistant("final", "It is sunny."))
    with http_client(ScriptedEngine(reply)) as client:
        choice = client.post("/v1/chat/completions", json=BODY).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == "It is sunny." and choice["message"]["reasoning"] == "Easy."
    assert "tool_calls" not in choice["message"]


def test_the_responses_api_returns_reasoning_and_function_call_items(calls):
    body = {
        "input": "Weather in Oslo?",
        "instructions": "Be brief.",
        "tools": [{"type": "function", **WEATHER["function"]}],
    }
    with http_client(ScriptedEngine(calls)) as client:
        response = client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    items = response.json()["output"]
    assert [item["type"] for item in items] == ["reasoning", "function_call"]
    assert items[0]["content"][0]["text"] == "Need the weather tool."
    assert items[1]["name"] == "get_weather" and items[1]["arguments"] == '{"city": "Oslo"}'


def test_tokenize_renders_chat_messages_through_harmony(chat):
    with http_client(ScriptedEngine([])) as client:
        tokens = client.post("/tokenize", json={"messages": BODY["messages"]}).json()["tokens"]
    text = chat.encoding.decode(tokens)
    assert text.startswith("<|start|>system<|message|>") and "Answer in one sentence." in text


def test_a_forced_tool_call_is_a_400_naming_tool_choice(calls):
    with http_client(ScriptedEngine(calls)) as client:
        response = client.post("/v1/chat/completions", json={**BODY, "tool_choice": "required"})
    assert_400(response, "tool_choice", "auto")


def test_only_gpt_oss_chats_in_harmony_and_the_parser_flags_it_leaves_unused_are_named(caplog):
    assert build_app(ScriptedEngine([]), "m").state.server.harmony is not None
    assert build_app(ScriptedEngine([], architecture="llama"), "m").state.server.harmony is None
    assert "--reasoning-parser unused" not in caplog.text
    build_app(ScriptedEngine([]), "m", reasoning_parser="qwen3")
    assert "--reasoning-parser unused" in caplog.text
