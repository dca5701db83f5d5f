"""Listening while the engine loads: the port answers from the start, so an orchestrator can tell a process that is
alive and still loading weights or compiling step shapes (minutes for a large model) from one that is dead.

Until the app is handed over, `/health` (liveness) is 200 and every other path, `/ready` included, is 503; then
every request goes to the app, whose `/ready` is 200 until the drain. The engine loads in a thread while uvicorn
serves on the main thread, which keeps uvicorn's signal handlers (SIGTERM drains, see lifecycle.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import Response
from jpaged_server.errors import error_response
from jpaged_server.lifecycle import GracefulServer
from starlette.types import ASGIApp, Receive, Scope, Send

from jpaged import start_up_collector

logger = logging.getLogger(__name__)

LOADING_MESSAGE = "the model is loading and its step shapes compiling; retry when /ready is 200"


class StartupApp:
    """The ASGI app uvicorn serves from its first second: the loading answers, then `app` once it is set."""

    def __init__(self) -> None:
        self.app: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            loading = (
                Response(status_code=200)
                if scope["path"] == "/health"
                else error_response(503, LOADING_MESSAGE)
            )
            await loading(scope, receive, send)


class EngineLoader:
    """Runs `load` (which returns the app over a warmed-up engine) in a thread and hands its app to the server;
    if it raises, the server stops and `error` holds why."""

    def __init__(self, load: Callable[[], FastAPI], startup: StartupApp, server: GracefulServer) -> None:
        self.app: FastAPI | None = None
        self.error: BaseException | None = None
        self._load, self._startup, self._server = load, startup, server
        # A daemon: a process told to stop while it loads exits without waiting for the load.
        self._thread = threading.Thread(target=self._run, name="jpaged-loader", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            app = self._load()
        except BaseException as err:  # run_server raises it once uvicorn has stopped
            self.error = err
            self._server.should_exit = True
            return
        self.app = app
        self._server.state = app.state.server  # before any request reaches it: a drain waits for its requests
        self._startup.app = app
        start_up_collector.resume()  # paused while the process started
        remaining = app.state.server.engine.metrics()["warmup_programs_remaining"]
        logger.info(
            "ready: weights loaded and warm-up done%s; /ready answers 200",
            f" ({remaining} step programs still compiling in the background)" if remaining else "",
        )
