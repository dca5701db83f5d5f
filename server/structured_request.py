"""A request's output constraint: OpenAI's `response_format` or vLLM's `structured_outputs` (or, for chat, a
forced tool call) as StructuredOutputsParams, compiled before the response starts so a bad schema is a 400.

The compile goes through the process's shared compiler (jpaged.structured.shared_compiler, the engine's too), in
its worker thread: the event loop never waits on it, and the engine then finds the grammar in the cache.
"""

from __future__ import annotations

import asyncio

from jpaged_server.errors import APIError
from jpaged_server.protocol import SamplingRequest
from jpaged_server.state import ServerState

from jpaged.sampling_params import StructuredOutputsParams
from jpaged.structured import shared_compiler


def requested_spec(body: SamplingRequest) -> tuple[StructuredOutputsParams, str] | None:
    """The constraint the request asks for and the field that asked, or None for free text."""
    fmt, given = body.response_format, body.structured_outputs
    if fmt is not None and fmt.type != "text" and given is not None:
        raise APIError(400, "give response_format or structured_outputs, not both", "structured_outputs")
    if given is not None:
        fields = {name: getattr(given, name) for name in ("regex", "choice", "grammar", "json_object")}
        try:
            return StructuredOutputsParams(json=given.json_, **fields), "structured_outputs"
        except ValueError as err:
            raise APIError(400, f"structured_outputs: {err}", "structured_outputs") from None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise APIError(400, "response_format json_schema needs json_schema.schema", "response_format")
    return StructuredOutputsParams(json=fmt.json_schema.json_schema), "response_format"


async def check_compiles(state: ServerState, spec: StructuredOutputsParams, param: str) -> None:
    """A 400 naming the problem if `spec` does not compile for this model's tokenizer."""
    engine = state.engine.engine
    config = engine.model_config
    compiler = shared_compiler(engine.tokenizer, config.vocab_size, tuple(config.eos_token_ids or ()) or None)
    try:
        await asyncio.wrap_future(compiler.submit(spec).future)
    except ValueError as err:
        raise APIError(400, f"{param}: {err}", param) from None
