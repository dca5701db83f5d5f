"""POST /v1/embeddings: one embedding per input (a string, strings, token ids, or lists of token ids), as floats or
base64 (little-endian float32, as OpenAI sends them), from a pooling engine (`--runner pooling --convert embed`).

A generation server refuses it with a 400, as vLLM does; a pooling server refuses the generation APIs likewise
(`add_pooling_routes`)."""

from __future__ import annotations

import asyncio
import base64
import uuid

import numpy as np
from fastapi import FastAPI, Request
from jpaged_server.embeddings_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from jpaged_server.errors import APIError
from jpaged_server.state import ServerState, get_state

from jpaged.engine.async_engine import AsyncLLMEngine, EngineDeadError, StepFailedError
from jpaged.pooling_params import EmbeddingRequestOutput, PoolingParams

GENERATION_APIS = {
    "/v1/completions": "Completions",
    "/v1/chat/completions": "Chat Completions",
    "/v1/responses": "Responses",
}
# What an engine ValueError names first -> the request field at fault.
_FIELDS = {"dimensions": "dimensions", "prompt": "input", "truncate_prompt_tokens": "truncate_prompt_tokens"}


def add_pooling_routes(app: FastAPI, engine: AsyncLLMEngine) -> None:
    """POST /v1/embeddings; on a pooling engine also a 400 for each generation API. Call before the generation
    routes are added: the routes first added answer a path."""
    app.post("/v1/embeddings")(create_embedding)
    if engine.engine.config.is_pooling:
        for path, api in GENERATION_APIS.items():
            app.post(path)(_refuse(api))


def _refuse(api: str):
    async def refuse() -> None:
        raise APIError(
            400,
            f"The model does not support the {api} API: this server runs it as a pooling (embedding) model "
            "(--runner pooling); use /v1/embeddings",
        )

    return refuse


async def create_embedding(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
    state = get_state(request)
    state.check_model(body.model)
    engine = state.engine.engine
    if not engine.config.is_pooling:
        raise APIError(
            400,
            "The model does not support the Embeddings API: serve it with --runner pooling --convert embed",
        )
    state.admit()
    params = _pooling_params(body)
    prompts = _checked_prompts(state, body, params)
    request_id = f"embd-{uuid.uuid4().hex}"
    state.in_flight += 1  # a drain waits for it (lifecycle.py)
    try:
        outputs = await _encode_all(state, prompts, params, request_id)
    finally:
        state.in_flight -= 1
    data = [
        EmbeddingData(index=i, embedding=_encoded(output.outputs.embedding, body.encoding_format))
        for i, output in enumerate(outputs)
    ]
    num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return EmbeddingResponse(
        id=request_id,
        model=state.model_name,
        data=data,
        usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )


async def _encode_all(
    state: ServerState, prompts: list[list[int]], params: PoolingParams, request_id: str
) -> list[EmbeddingRequestOutput]:
    """Every prompt's output, in order; the rest aborted (cancelled) when one fails or the drain's grace period
    ends."""
    tasks = [
        asyncio.ensure_future(state.engine.encode(ids, params, f"{request_id}-{i}"))
        for i, ids in enumerate(prompts)
    ]
    gathered = asyncio.gather(*tasks)
    shutdown = asyncio.ensure_future(state.shutdown.wait())
    try:
        done, _ = await asyncio.wait((gathered, shutdown), return_when=asyncio.FIRST_COMPLETED)
        if gathered not in done:
            raise APIError(503, "the server is shutting down; retry on another replica")
        return gathered.result()
    except EngineDeadError as err:
        raise APIError(503, f"the engine is not running: {err}") from err
    except StepFailedError as err:
        raise APIError(500, str(err)) from err
    finally:
        for task in (*tasks, shutdown):
            task.cancel()


def _pooling_params(body: EmbeddingRequest) -> PoolingParams:
    return PoolingParams(
        dimensions=body.dimensions,
        normalize=body.normalize,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
    )


def _checked_prompts(state: ServerState, body: EmbeddingRequest, params: PoolingParams) -> list[list[int]]:
    """Every input's token ids as they will run, each checked before any is queued (a 400 naming the field)."""
    inputs = body.input
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    if not inputs:
        raise APIError(400, "input is empty: give a string, a list of strings or token ids", "input")
    engine = state.engine.engine
    prompts = []
    for i, prompt in enumerate(inputs):
        if isinstance(prompt, str):
            ids = engine.tokenizer.encode(prompt, add_special_tokens=body.add_special_tokens)
        else:
            ids = list(prompt)
        try:
            prompts.append(engine.check_request(ids, params))
        except ValueError as err:
            message = str(err)
            field = _FIELDS.get(message.split(" ", 1)[0].rstrip(":"), "input")
            where = f"input[{i}]: " if field == "input" and len(inputs) > 1 else ""
            raise APIError(400, where + message, field) from err
    return prompts


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
    return embedding
