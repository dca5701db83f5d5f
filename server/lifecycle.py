"""Graceful shutdown: uvicorn with a drain phase between the signal and the exit.

On the first SIGTERM (or SIGINT) the server keeps listening but answers new generation requests and /ready with
503, so a load balancer moves traffic away while in-flight requests finish (/health, liveness, stays 200). When they are done, or the grace
period ends and the rest are aborted (their streams get a final error event), uvicorn shuts down and the process
exits 0. A second signal exits at once. Plain uvicorn instead closes its socket at the first signal and re-raises
the signal at the end, which makes the exit status 143, not 0.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI
from jpaged_server.state import ServerState
from starlette.types import ASGIApp

logger = logging.getLogger(__name__)

ABORTED_RESPONSE_SECONDS = 2.0  # after aborting, how long aborted responses get to send their last event
CONNECTION_CLOSE_SECONDS = 5.0  # uvicorn's own wait for connections once the drain is over


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState | None, grace_period: float) -> None:
        super().__init__(config)
        self.state = state  # None while the engine loads (startup.py): a drain then has nothing to wait for
        self._grace_period = grace_period
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None

    @classmethod
    def for_app(
        cls, app: ASGIApp, host: str, port: int, *, grace_period: float, log_level: str = "info"
    ) -> GracefulServer:
        """A server for a FastAPI app from build_app, or for a StartupApp (the state comes with its app)."""
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            lifespan="off",  # no app here has start-up or shutdown handlers
            timeout_graceful_shutdown=CONNECTION_CLOSE_SECONDS,
        )
        return cls(config, app.state.server if isinstance(app, FastAPI) else None, grace_period)

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's signal handler: drain on the first signal, exit now on the second."""
        if self._drain_requested:
            self.should_exit = self.force_exit = True
        else:
            self.request_shutdown()

    def request_shutdown(self) -> None:
        """Begin the drain; callable from any thread (and from a signal handler)."""
        if self._drain_requested:
            return
        self._drain_requested = True
        if self._loop is None:  # not serving yet
            self.should_exit = True
        else:
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        state, loop = self.state, asyncio.get_running_loop()
        if state is None:
            logger.info("stopping while the engine loads")
            self.should_exit = True
            return
        state.draining = True
        logger.info(
            "draining: %d requests in flight, grace period %.1f s", state.in_flight, self._grace_period
        )
        deadline = loop.time() + self._grace_period
        while state.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if state.in_flight:
            logger.warning("grace period over: aborting %d requests", state.in_flight)
            state.shutdown.set()
            deadline = loop.time() + ABORTED_RESPONSE_SECONDS
            while state.in_flight and loop.time() < deadline:
                await asyncio.sleep(0.02)
        self.should_exit = True
