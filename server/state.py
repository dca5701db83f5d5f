"""What every route shares: the engine, the served name, limits, metrics, and the draining flag."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request
from jpaged_server.errors import APIError
from jpaged_server.lora_adapters import LoRAAdapters
from jpaged_server.metrics import ServerMetrics
from jpaged_server.request_fields import check_request_fields
from pydantic import BaseModel

from jpaged import LoRARequest
from jpaged.engine.async_engine import AsyncLLMEngine

if TYPE_CHECKING:
    from jpaged_server.harmony import HarmonyChat

# An overloaded server's hint to come back: a queue of a few hundred requests moves within seconds.
RETRY_AFTER_SECONDS = "1"


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    model_name: str
    metrics: ServerMetrics
    api_key: str | None = None
    chat_template: str | None = None
    max_waiting_requests: int = 256
    draining: bool = False  # set on SIGTERM: new requests get 503 while in-flight ones finish
    shutdown: asyncio.Event = field(
        default_factory=asyncio.Event
    )  # set when the grace period ends: abort the rest
    in_flight: int = 0  # generation requests (HTTP) being served
    auto_tool_parser: str | None = None  # --tool-call-parser, when --enable-auto-tool-choice is on
    reasoning_parser: str | None = None  # --reasoning-parser
    strict_request_fields: bool = False  # --strict-request-fields: unknown request fields are a 400
    harmony: HarmonyChat | None = None  # gpt-oss's chat format, in place of the chat template and parsers
    loras: LoRAAdapters = field(init=False)  # the adapters a request's `model` may name besides model_name

    def __post_init__(self) -> None:
        self.loras = LoRAAdapters(self.model_name)

    def check_fields(self, body: BaseModel) -> dict[str, str]:
        """request_fields.check_request_fields under this server's --strict-request-fields."""
        return check_request_fields(body, strict=self.strict_request_fields)

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names, None for the base model (or no name); else a 404."""
        if model is None or model == self.model_name:
            return None
        lora = self.loras.get(model)
        if lora is None:
            served = ", ".join(repr(name) for name in [self.model_name, *(a.lora_name for a in self.loras)])
            raise APIError(404, f"the model {model!r} does not exist; this server serves {served}", "model")
        return lora

    def response_model(self, asked: str | None) -> str:
        """The `model` a response reports: the name its (checked) request gave, an adapter's as vLLM reports it,
        else the base model's."""
        return asked or self.model_name

    def admit(self) -> None:
        """Refuse new generation work while shutting down, after the engine died, or past the waiting cap.

        Requests beyond max_num_seqs wait in the scheduler; the engine counts requests, not sequences, so this
        bounds the queue to about max_waiting_requests."""
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another replica")
        if not self.engine.is_alive:
            raise APIError(503, "the engine is not running")
        capacity = self.engine.engine.config.max_num_seqs + self.max_waiting_requests
        if self.engine.num_unfinished >= capacity:
            raise APIError(
                503,
                f"the server is overloaded: {self.engine.num_unfinished} requests are running or waiting "
                f"(limit {capacity}); retry later",
                headers={"Retry-After": RETRY_AFTER_SECONDS},
            )

    def authorized(self, authorization_header: str) -> bool:
        if self.api_key is None:
            return True
        return secrets.compare_digest(authorization_header.encode(), f"Bearer {self.api_key}".encode())


def get_state(request: Request) -> ServerState:
    return request.app.state.server
