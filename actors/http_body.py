"""A bound on request body size for the HTTP API: a body over the limit gets 413 before any of it is
parsed, whether the client declared its length or streams it chunked. Every request body of this API is
a small JSON document (a prompt of at most the model's context), so the body is read whole here and
replayed to the app: nothing downstream ever holds more than the limit. A POST body without a JSON
content type (`curl -d '{...}'` sends form encoding by default) is declared JSON here, since every POST
body of this API is.

The 413 goes out whole before the rest of the body is read; the rest is then read and dropped (at most
``DRAIN_BYTES``, for at most ``DRAIN_SECONDS``) before the connection closes, as nginx's lingering close
does. Closing a socket with unread bytes in it sends a TCP reset, and a reset can overtake the answer
already sent: the client (or HAProxy in front) then sees the 413's headers and loses its body.

Plain ASGI, not a Starlette ``BaseHTTPMiddleware``: that one runs the app in a task group of its own with
memory streams between, a cost every request and every streamed chunk would pay."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Awaitable, Callable

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 4 << 20
DRAIN_BYTES = 64 << 20
DRAIN_SECONDS = 10.0


class BodyLimit:
    def __init__(self, app, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes!r}")
        self.app, self.limit = app, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        if scope.get("method") == "POST" and \
                headers.get(b"content-type", b"").split(b";")[0].strip().lower() in (b"", b"application/x-www-form-urlencoded"):
            scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers") or () if k != b"content-type"]
                     + [(b"content-type", b"application/json")]}
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._too_large(receive, send, int(declared), more_body=True)
            return
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return  # the client left before sending its body: nothing to answer
            body = msg.get("body", b"")
            size += len(body)
            if size > self.limit:
                await self._too_large(receive, send, size, more_body=msg.get("more_body", False))
                return
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: only a disconnect can come

        await self.app(scope, replay, send)

    async def _too_large(self, receive: Receive, send: Send, size: int, more_body: bool) -> None:
        body = json.dumps({"error": {"message": f"request body: {size} bytes exceed the limit of {self.limit}",
                                     "type": "invalid_request_error", "param": None, "code": 413}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
        # the whole answer is on the wire before the drain, so a client that reads it early has it all
        await send({"type": "http.response.body", "body": body, "more_body": True})
        if more_body:
            await _drain(receive)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _drain(receive: Receive) -> None:
    """Read and drop the rest of a request body, bounded in bytes and time."""
    dropped, deadline = 0, time.monotonic() + DRAIN_SECONDS
    while dropped <= DRAIN_BYTES:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            msg = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            return
        if msg["type"] != "http.request":
            return
        dropped += len(msg.get("body", b""))
        if not msg.get("more_body", False):
            return
