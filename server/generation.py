"""The engine requests behind one HTTP request: started together, outputs merged, aborted together.

A completions request with several prompts is one engine request per prompt. Their outputs (DELTA ones for a
stream, one FINAL_ONLY output per prompt otherwise) are merged into one stream of (prompt index, output). The stream
ends early, aborting every engine request at once so their KV blocks are freed, when the client disconnects or the
server's shutdown grace period ends.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from jpaged_server.errors import APIError
from jpaged_server.state import ServerState

from jpaged import LoRARequest
from jpaged.engine.async_engine import EngineDeadError, StepFailedError
from jpaged.outputs import RequestOutput
from jpaged.sampling_params import SamplingParams

_DONE = object()


@dataclass(slots=True)
class EngineInput:
    prompt_ids: list[int]
    params: SamplingParams


class GenerationStopped(Exception):
    """The client went away or the server shut down before the outputs finished; the engine requests are aborted."""

    def __init__(self, client_gone: bool) -> None:
        super().__init__(
            "the client disconnected" if client_gone else "the server is shutting down; request aborted"
        )
        self.client_gone = client_gone


def response_id(prefix: str, asked: str | None, http_request: Request) -> str:
    """The response's id: vLLM's, `<prefix>-<id>` with the id from the X-Request-Id header, else the body's
    `request_id`, else a random one."""
    return f"{prefix}-{http_request.headers.get('x-request-id') or asked or uuid.uuid4().hex}"


async def _client_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def generate_outputs(
    state: ServerState,
    request_id: str,
    inputs: list[EngineInput],
    http_request: Request,
    *,
    priority: int = 0,
    cache_salt: str | None = None,
    lora_request: LoRARequest | None = None,
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (input index, output) until every engine request finished, each served through `lora_request`'s
    adapter when one is given.

    Raises GenerationStopped on disconnect or shutdown, APIError(503) if the engine loop died, APIError(500) if a
    step that ran this request failed.
    """
    queue: asyncio.Queue = asyncio.Queue()
    engine_id = f"{request_id}-{uuid.uuid4().hex[:8]}"  # unique in the engine, whatever id the client chose

    async def pump(index: int, item: EngineInput) -> None:
        tracker = state.metrics.tracker()
        try:
            async for output in state.engine.generate(
                item.prompt_ids,
                item.params,
                f"{engine_id}-{index}",
                priority=priority,
                cache_salt=cache_salt,
                **adapter,
            ):
                tracker.observe(output)
                queue.put_nowait((index, output))
            queue.put_nowait(_DONE)
        except Exception as err:  # cancellation (a BaseException) is how the others stop it: not reported
            queue.put_nowait(err)

    adapter = {}  # without one, the engine call is the one every engine takes (a scripted one too)
    if lora_request is not None:
        adapter = {"lora_request": lora_request}
        state.metrics.lora_requests.labels(state.model_name, lora_request.lora_name).inc(len(inputs))
    state.in_flight += 1
    pumps = [asyncio.create_task(pump(i, item)) for i, item in enumerate(inputs)]
    disconnect = asyncio.create_task(_client_disconnected(http_request))
    shutdown = asyncio.create_task(state.shutdown.wait())
    getter: asyncio.Task | None = None
    try:
        remaining = len(pumps)
        while remaining:
            getter = asyncio.create_task(queue.get())
            done, _ = await asyncio.wait((getter, disconnect, shutdown), return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                raise GenerationStopped(client_gone=disconnect in done)
            item = getter.result()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, EngineDeadError):
                raise APIError(503, f"the engine is not running: {item}")
            elif isinstance(item, StepFailedError):  # this request's step failed; the engine serves on
                raise APIError(500, str(item))
            elif isinstance(item, ValueError):  # validated up front; kept so a gap there is still a 400
                raise APIError(400, str(item))
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        state.in_flight -= 1
        # Cancelling a pump closes its engine stream, which aborts the request before the next engine step.
        for task in (*pumps, disconnect, shutdown, getter):
            if task is not None:
                task.cancel()


async def final_output(outputs: AsyncIterator[tuple[int, RequestOutput]]) -> RequestOutput:
    """The one finished output of a single-prompt whole (FINAL_ONLY) response; a stop is a 503."""
    final = None
    try:
        async for _, output in outputs:
            final = output
    except GenerationStopped as stopped:
        raise APIError(503, str(stopped)) from None
    assert final is not None and final.finished
    return final
