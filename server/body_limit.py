"""A cap on request bodies: refused with 413 before they are read whole, so a client cannot make the server read,
parse and tokenise megabytes it would refuse anyway."""

from __future__ import annotations

from jpaged_server.errors import error_response
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimitMiddleware:
    """413 in OpenAI's error shape for a body over `max_bytes`: at once when Content-Length says so, else (a
    chunked body) at the chunk that crosses the limit, before the route sees any of it (plain ASGI, so streamed
    responses pass through untouched)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        received = 0
        started = refused = False

        async def counted_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    if not started:
                        await self._refuse(scope, receive, send)
                    return {"type": "http.disconnect"}  # the route stops reading: as if the client left
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 went out: the route's own answer to the cut-off body is dropped
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted_receive, watched_send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is over the server's limit of {self.max_bytes} bytes (--max-request-body-bytes)"
        await error_response(413, message)(scope, receive, send)
