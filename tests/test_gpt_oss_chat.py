"""A tiny random gpt-oss served end to end: the engine runs GptOssForCausalLM over the o200k vocabulary (201,088
ids, so harmony's tokens are in range; tokenizer built from harmony's vocabulary with tiktoken and transformers)
and the chat API renders through harmony. A random model's tokens are random (its replies never complete a
harmony header), so what is checked is the wiring: the prompt the engine ran is harmony's, harmony's stop tokens
end a reply, greedy whole and streamed replies are the same tokens and read back alike, and each reply's fields
are what the harmony reader makes of its tokens; test_harmony.py and test_harmony_server.py read known replies."""

from __future__ import annotations

import hashlib
import json

import pytest
from jpaged_server import harmony_vocab
from jpaged_server.harmony import HarmonyChat
from jpaged_server.protocol import ChatCompletionRequest
from server_harness import SMALL_ENGINE_ARGS, http_client, shared_engine

from jpaged.config import EngineConfig

pytestmark = pytest.mark.slow

O200K_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
BODY = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ],
    "reasoning_effort": "low",
    "temperature": 0,
    "max_tokens": 12,
    "return_token_ids": True,
}


@pytest.fixture(scope="module")
def chat() -> HarmonyChat:
    return HarmonyChat.load()


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory, chat) -> str:
    """A tiny random GptOssForCausalLM with the harmony tokenizer (tiktoken's o200k_harmony, read from the
    vocabulary harmony_vocab wrote, converted by transformers)."""
    import tiktoken
    import torch
    import transformers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    root = tmp_path_factory.mktemp("gpt_oss")
    vocab = harmony_vocab.ensure_encodings_base() / harmony_vocab.FILE_NAME
    cache = root / "tiktoken_cache"  # tiktoken's cache, keyed by the file's URL: nothing downloaded
    cache.mkdir()
    (cache / hashlib.sha1(O200K_URL.encode()).hexdigest()).write_bytes(vocab.read_bytes())
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TIKTOKEN_CACHE_DIR", str(cache))
        encoding = tiktoken.get_encoding("o200k_harmony")  # for its pattern and special tokens
    by_id: dict[int, str] = {}  # one name an id (200018 has two: <|endofprompt|> and its reserved name)
    for name, token in encoding._special_tokens.items():
        by_id.setdefault(token, name)
    assert sorted(by_id) == list(range(encoding.n_vocab - len(by_id), encoding.n_vocab))  # after the ranks
    specials = [by_id[token] for token in sorted(by_id)]  # the converter adds them in this order
    converted = TikTokenConverter(
        vocab_file=str(vocab), pattern=encoding._pat_str, extra_special_tokens=specials
    ).converted()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=converted,
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
    )
    model_dir = root / "model"
    tokenizer.save_pretrained(model_dir)
    config = transformers.GptOssConfig(
        vocab_size=201088,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        eos_token_id=199999,  # <|endoftext|> only: an end at <|call|> or <|return|> is harmony's stop tokens'
        pad_token_id=199999,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    assert tokenizer.encode("<|channel|>final", add_special_tokens=False) == chat.encoding.encode(
        "<|channel|>final", allowed_special="all"
    )
    return str(model_dir)


@pytest.fixture(scope="module")
def client(gpt_oss_dir):
    config = EngineConfig(model=gpt_oss_dir, **{**SMALL_ENGINE_ARGS, "max_model_len": 512})
    with http_client(shared_engine(config)) as client:
        yield client


def test_the_engine_runs_harmonys_prompt_and_the_reply_is_read_from_its_tokens(client, chat):
    response = client.post("/v1/chat/completions", json=BODY)
    assert response.status_code == 200, response.text
    answer = response.json()
    rendered = chat.prompt(ChatCompletionRequest.model_validate(BODY))
    assert answer["prompt_token_ids"] == rendered.ids
    [choice] = answer["choices"]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    expected = rendered.reply.message("", choice["token_ids"]).model_dump()
    for call in expected.get("tool_calls") or ():
        call.pop("id")
    message = choice["message"]
    for call in message.get("tool_calls") or ():
        assert call.pop("id").startswith("call_")
    assert message == expected


def test_harmonys_stop_tokens_end_the_reply(client):
    answer = client.post("/v1/chat/completions", json={**BODY, "allowed_token_ids": [200012]}).json()
    [choice] = answer["choices"]
    assert choice["token_ids"] == [200012]  # <|call|>, not the model's EOS
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", 200012)


def test_greedy_whole_and_streamed_replies_agree(client):
    whole = client.post("/v1/chat/completions", json=BODY).json()["choices"][0]
    with client.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line)["choices"][0] for line in lines[:-1]]
    assert [t for c in chunks for t in c.get("token_ids") or ()] == whole["token_ids"]
    deltas = [c["delta"] for c in chunks]
    message = whole["message"]
    assert "".join(d.get("reasoning") or "" for d in deltas) == (message.get("reasoning") or "")
    assert "".join(d.get("content") or "" for d in deltas) == (message["content"] or "")
    assert chunks[-1]["finish_reason"] == whole["finish_reason"]


def test_the_responses_api_serves_gpt_oss(client):
    body = {"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 8, "temperature": 0}
    response = client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["status"] in ("completed", "incomplete")
