"""A sample of real traffic for the planner: JSONL, one request a line, as {"prompt": text} or {"messages": [chat
messages]} (rendered with the model's chat template, as the server would), with the model's reply as "response"
when it is known."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jpaged.engine.tokenizer import apply_chat_template


@dataclass(frozen=True)
class TrafficRequest:
    prompt_ids: list[int]
    response_tokens: int
    texts: tuple[str, ...]  # what the client wrote and the reply, for counting tokens by script

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + self.response_tokens


def read_traffic(path: Path, tokenizer, chat_template: str | None = None) -> list[TrafficRequest]:
    """Every request of the file, tokenised; ValueError naming the line and field of a malformed one."""
    requests = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"traffic {path} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not JSON ({err})") from None
        response = row.get("response") or ""
        if not isinstance(response, str):
            raise ValueError(f"{where}: 'response' must be a string")
        if isinstance(row.get("messages"), list):
            messages = row["messages"]
            if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
                raise ValueError(f"{where}: each of 'messages' needs a 'content' string")
            prompt_ids = apply_chat_template(tokenizer, messages, chat_template=chat_template)
            written = tuple(m["content"] for m in messages)
        elif isinstance(row.get("prompt"), str):
            prompt_ids = tokenizer.encode(row["prompt"], add_special_tokens=True)
            written = (row["prompt"],)
        else:
            raise ValueError(f"{where}: needs a 'prompt' string or a 'messages' list")
        response_tokens = len(tokenizer.encode(response, add_special_tokens=False)) if response else 0
        requests.append(
            TrafficRequest(prompt_ids, response_tokens, (*written, response) if response else written)
        )
    if not requests:
        raise ValueError(f"traffic {path} has no requests")
    return requests
