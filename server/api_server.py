"""The FastAPI app (routes, auth, errors) and `run_server`, which serves it with uvicorn until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from jpaged_server.body_limit import BodySizeLimitMiddleware
from jpaged_server.chat_template import chat_prompt_ids, load_chat_template
from jpaged_server.cli import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_MAX_STORED_RESPONSES,
    auto_tool_parser,
    lora_modules,
)
from jpaged_server.errors import APIError, error_response, install_error_handlers
from jpaged_server.lifecycle import GracefulServer
from jpaged_server.lora_adapters import LoRAModule
from jpaged_server.metrics import ServerMetrics
from jpaged_server.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeRequest,
)
from jpaged_server.response_store import ResponseStore
from jpaged_server.serving_chat import create_chat_completion
from jpaged_server.serving_completions import create_completion
from jpaged_server.serving_embeddings import add_pooling_routes
from jpaged_server.serving_lora import add_lora_routes
from jpaged_server.serving_responses import create_response, delete_response, retrieve_response
from jpaged_server.startup import EngineLoader, StartupApp
from jpaged_server.state import ServerState, get_state
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

import jpaged
from jpaged.config import EngineConfig
from jpaged.engine.async_engine import AsyncLLMEngine

if TYPE_CHECKING:
    from jpaged_server.harmony import HarmonyChat

logger = logging.getLogger(__name__)

# Probes and scrapers carry no API key.
OPEN_PATHS = frozenset({"/health", "/ready", "/version", "/metrics", "/ping"})
DEFAULT_MODEL_NAME = "jpaged-default"


def build_app(
    engine: AsyncLLMEngine,
    served_model_name: str,
    api_key: str | None = None,
    chat_template: str | None = None,
    *,
    max_waiting_requests: int = 256,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    auto_tool_parser: str | None = None,
    reasoning_parser: str | None = None,
    strict_request_fields: bool = False,
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
    lora_modules: Sequence[LoRAModule] = (),
    allow_runtime_lora_updating: bool = False,
) -> FastAPI:
    """An OpenAI-compatible app over a running engine, warmed up (AsyncLLMEngine.from_config returns after its
    warm-up): its /ready is 200 from the start. The caller owns the engine (and shuts it down).

    `lora_modules` are added to the engine here (a bad adapter raises its ValueError), each then a `model` name."""
    app = FastAPI(title="jpaged", version=jpaged.__version__)
    app.state.server = ServerState(
        engine=engine,
        model_name=served_model_name,
        metrics=ServerMetrics(engine, served_model_name),
        api_key=api_key,
        chat_template=chat_template,
        max_waiting_requests=max_waiting_requests,
        auto_tool_parser=auto_tool_parser,
        reasoning_parser=reasoning_parser,
        strict_request_fields=strict_request_fields,
        harmony=harmony_for(engine),
    )
    if app.state.server.harmony is not None and (chat_template or auto_tool_parser or reasoning_parser):
        logger.warning(
            "gpt-oss chats in harmony: --chat-template, --tool-call-parser and --reasoning-parser unused"
        )
    for module in lora_modules:
        lora = app.state.server.loras.new_request(module, engine.list_loras())
        engine.add_lora(lora)
        app.state.server.loras.add(lora)
    app.state.responses = ResponseStore(max_stored_responses)  # the Responses API's previous_response_id
    install_error_handlers(app)
    app.add_middleware(APIKeyMiddleware, state=app.state.server)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes)  # outermost: before auth
    add_pooling_routes(app, engine)  # first: on a pooling engine its refusals answer the generation paths
    app.post("/v1/completions")(create_completion)
    app.post("/v1/chat/completions")(create_chat_completion)
    app.post("/v1/responses")(create_response)
    app.get("/v1/responses/{response_id}")(retrieve_response)
    app.delete("/v1/responses/{response_id}")(delete_response)
    if allow_runtime_lora_updating:
        add_lora_routes(app)
    _add_info_routes(app)
    return app


def harmony_for(engine: AsyncLLMEngine) -> HarmonyChat | None:
    """gpt-oss models chat in harmony (harmony.py), as vLLM serves them, whatever --chat-template,
    --reasoning-parser and --tool-call-parser say; other models have none."""
    if engine.engine.model_config.architecture != "gpt_oss":
        return None
    try:
        from jpaged_server.harmony import HarmonyChat
    except ModuleNotFoundError as err:
        raise RuntimeError(
            f"gpt-oss models chat in the harmony format, which needs {err.name}: pip install 'jpaged[gpt-oss]'"
        ) from err
    return HarmonyChat.load()


class APIKeyMiddleware:
    """401 for every path but the open ones unless `Authorization: Bearer <key>` matches (plain ASGI, so
    streamed responses and client disconnects pass through untouched)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        needs_key = scope["type"] == "http" and scope["path"] not in OPEN_PATHS
        if needs_key and not self.state.authorized(Headers(scope=scope).get("authorization", "")):
            response = error_response(401, "invalid or missing API key: send 'Authorization: Bearer <key>'")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _add_info_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        """Liveness: 503 only when the engine cannot serve again (restart the process); 200 while draining."""
        state = get_state(request)
        if not state.engine.is_alive:
            return error_response(503, state.engine.failure)
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping(request: Request) -> Response:
        """vLLM's (and SageMaker's) liveness probe: /health under another name."""
        return await health(request)

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        """Readiness: whether to send this replica requests; 503 while loading (startup.py) and draining."""
        state = get_state(request)
        if not state.engine.is_alive:
            return error_response(503, state.engine.failure)
        if state.draining:
            return error_response(503, "the server is shutting down")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": jpaged.__version__}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        # engine.metrics() waits for the engine lock (up to one step): keep the event loop free meanwhile.
        body = await asyncio.to_thread(get_state(request).metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        state = get_state(request)
        base = ModelCard(id=state.model_name, root=state.model_name, max_model_len=state.max_model_len)
        adapters = [
            ModelCard(
                id=lora.lora_name,
                root=lora.lora_path,
                parent=lora.base_model_name or state.model_name,
                max_model_len=state.max_model_len,
            )
            for lora in state.loras
        ]
        return ModelList(data=[base, *adapters])

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> Response:
        state = get_state(request)
        state.check_model(body.model)
        headers = state.check_fields(body)
        tokenizer = state.engine.engine.tokenizer
        if isinstance(body, TokenizeChatRequest):
            if body.continue_final_message and body.add_generation_prompt:
                raise APIError(
                    400,
                    "continue_final_message and add_generation_prompt cannot both be true",
                    "continue_final_message",
                )
            if state.harmony is not None:
                chat = ChatCompletionRequest(
                    messages=body.messages,
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    chat_template_kwargs=body.chat_template_kwargs,
                )
                tokens = state.harmony.prompt(chat).ids
            else:
                tokens = chat_prompt_ids(
                    tokenizer,
                    body.messages,
                    chat_template=state.chat_template,
                    add_generation_prompt=body.add_generation_prompt,
                    template_kwargs=body.chat_template_kwargs,
                    continue_final_message=body.continue_final_message,
                    add_special_tokens=body.add_special_tokens,
                )
        else:
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        answer = {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens}
        return JSONResponse(answer, headers=headers)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
        state = get_state(request)
        state.check_model(body.model)
        headers = state.check_fields(body)
        vocab_size = state.engine.engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"tokens {bad[:5]} are outside the vocabulary [0, {vocab_size})", "tokens")
        return JSONResponse({"prompt": state.engine.engine.tokenizer.decode(body.tokens)}, headers=headers)


def run_server(args: argparse.Namespace, config: EngineConfig) -> int:
    """Listen, load and warm up the engine meanwhile (startup.py), serve until SIGTERM/SIGINT, drain within the
    grace period, exit 0. A load that fails raises its error once the server has stopped."""
    if args.max_waiting_requests < 0:
        raise ValueError(f"max_waiting_requests must be >= 0, got {args.max_waiting_requests}")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes must be >= 1, got {args.max_request_body_bytes}")
    if args.shutdown_grace_period < 0:
        raise ValueError(f"shutdown_grace_period must be >= 0 seconds, got {args.shutdown_grace_period}")
    chat_template = load_chat_template(args.chat_template)
    tool_parser = auto_tool_parser(args)
    adapters = lora_modules(args, config)

    def load() -> FastAPI:
        return build_app(
            AsyncLLMEngine.from_config(config),
            args.served_model_name or config.model or DEFAULT_MODEL_NAME,
            args.api_key,
            chat_template,
            max_waiting_requests=args.max_waiting_requests,
            max_request_body_bytes=args.max_request_body_bytes,
            auto_tool_parser=tool_parser,
            reasoning_parser=args.reasoning_parser,
            strict_request_fields=args.strict_request_fields,
            max_stored_responses=args.max_stored_responses,
            lora_modules=adapters,
            allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        )

    startup = StartupApp()
    server = GracefulServer.for_app(startup, args.host, args.port, grace_period=args.shutdown_grace_period)
    loader = EngineLoader(load, startup, server)
    loader.start()
    try:
        server.run()
    finally:
        if loader.app is not None:
            loader.app.state.server.engine.shutdown(timeout=5.0)
    if loader.error is not None:
        raise loader.error
    return 0
