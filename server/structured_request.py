"""A request's output constraint: OpenAI's `response_format` or vLLM's `structured_outputs` (or, for chat, a
forced tool call) as StructuredOutputsParams, compiled before the response starts so a bad schema is a 400.

The compile goes through the process's shared compiler (jpaged.structured.shared_compiler, the engine's too), in
its worker thread: the event loop never waits on it, and the engine then finds the grammar in the cache.
"""

from __future__ import annotations

import asyncio

from jpaged_server.errors import APIError
from jpaged_server.protocol import ResponseFormat, SamplingRequest
from jpaged_server.state import ServerState

from jpaged.sampling_params import StructuredOutputsParams
from jpaged.structured import shared_compiler


def requested_spec(body: SamplingRequest) -> tuple[StructuredOutputsParams, str] | None:
    """The constraint the request asks for and the field that asked, or None for free text."""
    asked: dict[str, dict] = {}  # field -> StructuredOutputsParams' keyword arguments
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        asked["response_format"] = _response_format_fields(fmt)
    if (given := body.structured_outputs) is not None:
        names = ("regex", "choice", "grammar", "json_object")
        asked["structured_outputs"] = {"json": given.json_, **{name: getattr(given, name) for name in names}}
    for kind in ("json", "regex", "choice", "grammar"):  # vLLM's older spelling, one field a kind
        if (value := getattr(body, f"guided_{kind}")) is not None:
            asked[f"guided_{kind}"] = {kind: value}
    if not asked:
        return None
    if len(asked) > 1:
        many = "not both" if len(asked) == 2 else "not several"
        raise APIError(400, f"give one of {' and '.join(asked)}, {many}", list(asked)[-1])
    ((param, fields),) = asked.items()
    try:
        return StructuredOutputsParams(**fields), param
    except ValueError as err:
        raise APIError(400, f"{param}: {err}", param) from None


def _response_format_fields(fmt: ResponseFormat) -> dict:
    if fmt.type == "json_object":  # instructor's JSON_SCHEMA mode sends its schema beside the type
        return {"json": fmt.schema_} if fmt.schema_ else {"json_object": True}
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise APIError(400, "response_format json_schema needs json_schema.schema", "response_format")
    return {"json": fmt.json_schema.json_schema}


async def check_compiles(state: ServerState, spec: StructuredOutputsParams, param: str) -> None:
    """A 400 naming the problem if `spec` does not compile for this model's tokenizer."""
    engine = state.engine.engine
    config = engine.model_config
    compiler = shared_compiler(engine.tokenizer, config.vocab_size, tuple(config.eos_token_ids or ()) or None)
    try:
        await asyncio.wrap_future(compiler.submit(spec).future)
    except ValueError as err:
        raise APIError(400, f"{param}: {err}", param) from None
