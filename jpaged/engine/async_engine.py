"""AsyncLLMEngine: the engine loop in its own thread, one asyncio stream of outputs per request.

The server's event loop never waits for a device step. Adding a request runs in a worker thread (it waits for the
engine lock while a step runs, the event loop does not); aborts are queued and applied by the loop thread before
its next step; outputs come back with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Sequence

from jpaged.config import EngineConfig
from jpaged.engine.engine_metrics import ExpertLoad
from jpaged.engine.llm_engine import LLMEngine
from jpaged.engine.lora_adapters import LoRAStats
from jpaged.engine.pooling_engine import engine_for
from jpaged.engine.speculation import SpecDecodeStats
from jpaged.lora_request import LoRARequest
from jpaged.outputs import RequestOutput
from jpaged.pooling_params import EmbeddingRequestOutput, PoolingParams
from jpaged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an exception; the server reports unhealthy."""


class StepFailedError(RuntimeError):
    """A step raised while this request ran in it: the request is aborted (its blocks freed), the engine goes on."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._aborts: deque[str] = deque()
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="jpaged-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        return cls(engine_for(config))

    @property
    def failure(self) -> str | None:
        """Why the engine cannot serve (its loop died, or the devices cannot go on), or None."""
        if self.error is not None:
            return f"the engine loop died: {self.error!r}"
        if self.engine.runner.failure is not None:
            return self.engine.runner.failure
        return None if self._thread.is_alive() else "the engine loop has stopped"

    @property
    def is_alive(self) -> bool:
        return self.failure is None

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | PoolingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it progresses (as its params.output_kind says), the last with `finished=True`.

        Validation errors raise ValueError before anything is queued. If the consumer stops early (a client
        disconnect cancels it), the request is aborted before the engine's next step, even when that happens
        while the request is still being added.
        """
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running: {self.failure}")
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def add() -> None:
            with self._lock:
                self.engine.add_request(
                    request_id,
                    prompt,
                    params,
                    priority=priority,
                    cache_salt=cache_salt,
                    lora_request=lora_request,
                )
                self._streams[request_id] = (loop, queue)

        adding = asyncio.ensure_future(asyncio.to_thread(add))
        try:
            await asyncio.shield(adding)  # the thread adds it whatever happens to this consumer
        except asyncio.CancelledError:  # a consumer gone while its request was being added: abort it once in
            adding.add_done_callback(lambda done: done.exception() or self.abort(request_id))
            raise
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, StepFailedError):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDeadError("the engine loop failed") from item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    async def encode(
        self, prompt: str | Sequence[int], params: PoolingParams, request_id: str
    ) -> EmbeddingRequestOutput:
        """One pooling request's output (a pooling engine's: see PoolingEngine); ValueError before anything is
        queued for bad input."""
        async for output in self.generate(prompt, params, request_id):
            return output
        raise EngineDeadError(f"request {request_id} ended without an output")

    def abort(self, request_id: str) -> None:
        """Abort before the next step; the stream, if still read, gets a last output with finish_reason 'abort'."""
        self._aborts.append(request_id)
        self._wake.set()

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return self.engine.metrics()

    def expert_load(self) -> ExpertLoad | None:
        with self._lock:
            return self.engine.expert_load()

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        with self._lock:
            return self.engine.spec_decode_stats()

    # LoRA adapters (LLMEngine's): add_lora reads the adapter's files, so call it from a thread.
    def add_lora(self, lora_request: LoRARequest) -> bool:
        with self._lock:
            return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        with self._lock:
            return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        with self._lock:
            return self.engine.list_loras()

    def lora_stats(self) -> LoRAStats:
        with self._lock:
            return self.engine.lora_stats()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop thread once the in-flight requests finish or `timeout` passes, then abort the rest."""
        self._stopping = True
        self._wake.set()
        self.engine.warmup.stop()
        self._thread.join(timeout)
        with self._lock:
            for request_id in list(self._streams):
                self._streams.pop(request_id)
                self.engine.abort_request(request_id)

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    outputs = [
                        o for o in map(self.engine.abort_request, self._drain_aborts()) if o is not None
                    ]
                    busy = self.engine.has_unfinished()
                    if busy:
                        try:
                            outputs += self.engine.step()
                        except Exception as err:
                            self._fail_step(err)
                    elif not self._stopping:
                        busy = self.engine.warm_up_while_idle()
                    deliveries = [(self._streams.get(o.request_id), o) for o in outputs]
                    for output in outputs:
                        if output.finished:
                            self._streams.pop(output.request_id, None)
                for stream, output in deliveries:
                    if stream is not None and not _deliver(stream, output) and not output.finished:
                        self.abort(output.request_id)  # its reader went with its event loop
                if not busy:
                    if self._stopping:
                        return
                    self._wake.wait(0.5)
                    self._wake.clear()
        except BaseException as err:  # surfaced through /health and to every waiting stream
            logger.exception("engine loop died")
            self.error = err
            for stream in list(self._streams.values()):
                _deliver(stream, err)

    def _fail_step(self, err: Exception) -> None:
        """A step raised: fail the requests the scheduler runs (the step's, and those of the step in flight beside
        it) with StepFailedError and abort them; waiting requests stay queued and the loop goes on. Re-raised (the
        loop dies) when the devices cannot go on, or when no request ran to blame."""
        failed = {seq.request.request_id for seq in self.engine.scheduler.running}
        if self.engine.runner.failure is not None or not failed:
            raise err
        logger.exception("an engine step failed: aborting its %d requests", len(failed))
        for request_id in failed:
            self.engine.abort_request(request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                _deliver(stream, StepFailedError(f"the engine step running this request failed: {err!r}"))

    def _drain_aborts(self) -> list[str]:
        ids = []
        while self._aborts:
            ids.append(self._aborts.popleft())
        return ids


def _deliver(stream: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item) -> bool:
    """Hand `item` to a request's stream; False when the stream's event loop has closed (a server shutting down
    while the request still runs), which leaves nobody to read it."""
    loop, queue = stream
    try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
    except RuntimeError:
        return False
    return True
