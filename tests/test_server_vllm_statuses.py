"""Every request body of tests/data/vllm_request_statuses.json, the shapes real clients send (openai SDK,
LangChain, instructor, the Agents SDK, guidellm, `vllm bench serve`) and bad inputs, gets from jpaged the status
class vLLM answers it with (measured by scripts/vllm_request_statuses.py against vLLM's CPU build); a streamed 200
is read to its end and ends as vLLM's did.

The server is built as the table's vLLM was started: served as "tiny", max_model_len 256, hermes tool calls.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from jpaged_server.api_server import build_app
from server_harness import SMALL_ENGINE_ARGS, serve_in_thread

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from vllm_request_statuses import MAX_MODEL_LEN, SERVED_NAME, TABLE, send  # noqa: E402

ENTRIES = json.loads(TABLE.read_text())["entries"]


@pytest.fixture(scope="module")
def http(engine):
    assert SMALL_ENGINE_ARGS["max_model_len"] == MAX_MODEL_LEN  # the limit vLLM was measured under
    app = build_app(engine, SERVED_NAME, auto_tool_parser="hermes")
    with serve_in_thread(app) as running, httpx.Client(base_url=running.base_url, timeout=120) as client:
        yield client


def test_the_table_holds_measured_statuses_for_what_clients_send_and_bad_inputs():
    assert len(ENTRIES) >= 50
    assert all(isinstance(entry["vllm_status"], int) for entry in ENTRIES)
    assert {entry["vllm_status"] // 100 for entry in ENTRIES} >= {2, 4}


@pytest.mark.parametrize("entry", ENTRIES, ids=[entry["name"] for entry in ENTRIES])
def test_jpaged_answers_with_the_status_class_vllm_answers(http, entry):
    if "model_difference" in entry:  # an answer that differs for a reason of the model, not the server
        pytest.xfail(entry["model_difference"])
    result = send(http, entry, SERVED_NAME)
    expected = entry["vllm_status"]
    assert result["status"] // 100 == expected // 100, (
        f"jpaged {result['status']} ({result.get('reason', '')}); vLLM {expected} ({entry.get('vllm_reason', '')})"
    )
    if "vllm_stream" in entry:
        assert ending(result.get("stream")) == ending(entry["vllm_stream"]), result


def ending(stream_end: str | None) -> str | None:
    """How a stream ended, as its clients see it: a chat or completions stream with [DONE], a Responses API stream
    with a terminal event (vLLM sends response.completed even for an incomplete response, OpenAI
    response.incomplete: the SDKs read the response's status either way)."""
    if stream_end in ("response.completed", "response.incomplete"):
        return "a Responses API terminal event"
    return stream_end
