"""What the HTTP port answers while strata is not serving. Serve's proxy opens the port before any
application exists and answers 404 for a path it has no route for, so a `curl -s .../health` would look
healthy while the workers still load. Two things answer 503 "starting" instead: ``NoRouteIsStarting`` in
the proxy until the proxy knows the route, then ``StartingIngress``, which launch deploys on the
ingress's route before the workers, until the real ingress replaces it (a rolling update that starts the
new replica before it stops this one)."""
from __future__ import annotations

import json

from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse

STARTING = {"ok": False, "status": "starting"}
DRAINING = {"ok": False, "status": "draining"}


class StartingIngress:
    """503 on every path until the cluster is ready: /health with ``STARTING``, anything else with an error
    in the API's shape. Deliberately tiny (no FastAPI, no tokenizer) so its replica is up within a second
    or two of the port."""

    async def __call__(self, request: Request) -> JSONResponse:
        headers = {"Retry-After": "2"}
        if request.url.path.rstrip("/").endswith("/health"):
            return JSONResponse(STARTING, status_code=503, headers=headers)
        err = {"message": "strata is starting: the workers are not ready yet", "type": "server_error",
               "param": None, "code": 503}
        return JSONResponse({"error": err, **STARTING}, status_code=503, headers=headers)

    async def phase(self) -> str:
        return "starting"


class NoRouteIsStarting:
    """ASGI middleware for Serve's HTTP proxy (installed by ``proxy_middlewares``). The proxy opens the
    port before its first route table arrives from the controller (1-2 s on a busy box) and meanwhile
    answers 404 text/plain "Path ... not found" even for /health. strata's app owns the route "/", so
    such a 404 can only mean no app is routed yet: answer 503 ``STARTING`` instead. The app's own 404s
    are JSON and pass unchanged."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        replaced = False

        async def send_or_replace(message) -> None:
            nonlocal replaced
            if message["type"] == "http.response.start" and message["status"] == 404 \
                    and _content_type(message.get("headers", ())).startswith(b"text/plain"):
                replaced = True
                body = json.dumps(STARTING, separators=(",", ":")).encode()
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode()), (b"retry-after", b"2")]})
                await send({"type": "http.response.body", "body": body})
            elif not replaced:      # (the 404's own body is dropped)
                await send(message)

        await self.app(scope, receive, send_or_replace)


def _content_type(headers) -> bytes:
    for k, v in headers:
        if k.lower() == b"content-type":
            return v.lower()
    return b""


def proxy_middlewares() -> list:
    """The proxy callback (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=actors.lifecycle:proxy_middlewares,
    which cluster/launch.py's RAY_ENV sets for the clusters it starts)."""
    return [Middleware(NoRouteIsStarting)]
