"""The Responses API's store: finished responses by id, for `previous_response_id` and GET /v1/responses/{id}.

vLLM keeps every stored response for the life of the process; here the store holds at most `max_size` of them
(--max-stored-responses) and forgets the least recently used first, so a long-running server's memory stays
bounded. A response that was forgotten answers 404, as one never stored does.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as it was returned (JSON-ready)
    messages: list[dict[str, Any]]  # the chat messages of its prompt, without the system instructions


@dataclass(slots=True)
class ResponseStore:
    """An LRU map of response id -> StoredResponse; reading an entry counts as using it."""

    max_size: int
    _entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.max_size < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {self.max_size}")

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.max_size == 0:
            return
        self._entries[response_id] = stored
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
