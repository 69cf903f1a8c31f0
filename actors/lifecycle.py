"""What the HTTP port answers while strata is not serving. The front (HAProxy, or Serve's proxy: server.front)
opens the port before any application exists and answers 404 for a path it has no route for, so a
`curl -s .../health` would look healthy while the workers still load. Two things answer 503 "starting"
instead: until the front knows the route, HAProxy's no-route answer rewritten by ``haproxy_no_route_is_starting``
(or, in Serve's proxy, the ``NoRouteIsStarting`` middleware); then ``StartingIngress``, which launch
deploys on the ingress's route before the workers, until the real ingress replaces it (a rolling update
that starts the new replica before it stops this one)."""
from __future__ import annotations

import json
import logging
import re

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


# Ray's HAProxy config template (ray.serve._private.haproxy_templates) sends a path no application routes
# to ``backend default_backend``, which answers a text/plain 404. strata's app owns the route "/", so that
# backend is reached only while no app is routed yet: the same case as NoRouteIsStarting's.
_NO_ROUTE_404 = re.compile(r"(\nbackend default_backend\n)    http-request return status 404[^\n]*")


def starting_instead_of_no_route(template: str) -> str:
    """Ray's HAProxy config template with ``default_backend`` answering 503 ``STARTING`` (JSON, Retry-After)
    instead of its 404. Raises ValueError where the template has no such backend (another Ray)."""
    body = json.dumps(STARTING, separators=(",", ":")).replace('"', '\\"')
    answer = f'    http-request return status 503 content-type application/json string "{body}" hdr retry-after 2'
    out, n = _NO_ROUTE_404.subn(lambda m: m.group(1) + answer, template)
    if n != 1:
        raise ValueError("Ray's HAProxy template has no `backend default_backend` answering 404")
    return out


# Ray's template binds HAProxy's Prometheus exporter and stats page on every interface, whatever
# http_options.host says; strata's local clusters keep everything on loopback (cluster/launch.py RAY_ENV).
_ALL_INTERFACES = (("bind :{{ config.metrics_port }}", "bind {{ config.frontend_host }}:{{ config.metrics_port }}"),
                   ("bind *:{{ config.stats_port }}", "bind {{ config.frontend_host }}:{{ config.stats_port }}"))


# Ray's backends reuse idle server connections for any request ("always"). When the replica dies with a
# request in flight on such a reused connection, HAProxy takes the empty answer for the race of a server
# closing an idle connection and closes the client's connection without a word (measured: every time, even
# for a client's first request). "safe" gives each client connection's first request a connection of its
# own, so a replica lost mid-request is a 502 to a client that connects per request, not a dropped
# connection; later requests of a connection still reuse.
_REUSE = ("http-reuse always", "http-reuse safe")


# What HAProxy itself answers when no replica does: Ray's template sends one text/plain "500 Internal Server
# Error" file for its 502 (the replica closed the connection before answering: it died or stopped with the
# request in flight), 503 (no replica to send it to) and 504. strata keeps each status, answers it in the
# API's error shape like every other error, and says when to retry: HTTP clients that retry (the OpenAI SDK,
# urllib3's usual status list) then retry at once, with a message that says what happened.
FRONT_ERRORS = {
    502: ("the ingress replica closed the connection before answering (it stopped or failed); "
          "the request can be sent again", 1),
    503: ("no ingress replica can take the request now (starting, restarting or stopping)", 2),
    504: ("the ingress replica did not answer in time", 1),
}
_SERVE_500_COMMENT = ("    # Normalize 502/503/504 to 500 per Serve's default behavior. 503\n"
                      "    # covers HAProxy's own \"all retries exhausted / no server\" response.")
_ERRORFILE = re.compile(r"errorfile (50[234]) \{\{ config\.error_file_path \}\}")


def front_error_body(status: int) -> dict:
    """The JSON HAProxy sends for ``status`` (502, 503, 504): OpenAI's error object, as the app's errors."""
    from actors.openai_errors import body
    return body(FRONT_ERRORS[status][0], status)


def _http_error(m: re.Match) -> str:
    status = int(m.group(1))
    text = json.dumps(front_error_body(status), separators=(",", ":")).replace('"', '\\"')
    return (f'http-error status {status} content-type application/json string "{text}" '
            f"hdr retry-after {FRONT_ERRORS[status][1]}")


def json_front_errors(template: str) -> str:
    """Ray's HAProxy config template with HAProxy's own 502/503/504 answered by ``front_error_body`` (JSON,
    Retry-After) instead of its text/plain 500 file. Raises ValueError where the template has no such lines
    (another Ray)."""
    out, n = _ERRORFILE.subn(_http_error, template)
    if n != len(FRONT_ERRORS):
        raise ValueError(f"Ray's HAProxy template has {n} of the 3 errorfile lines strata replaces")
    return out.replace(_SERVE_500_COMMENT, "    # strata: HAProxy's own 502/503/504 as JSON (actors/lifecycle.py)")


def strata_haproxy_template(template: str) -> str:
    """Ray's HAProxy config template as strata runs it: ``starting_instead_of_no_route``, HAProxy's side
    listeners bound where its HTTP front is (loopback for `make run`, every interface on a pod), server
    connections reused only where a dying replica cannot drop a client's request silently, and HAProxy's
    own errors in the API's shape (``json_front_errors``; where Ray's template differs, its file stays)."""
    out = starting_instead_of_no_route(template)
    for old, new in (*_ALL_INTERFACES, _REUSE):
        out = out.replace(old, new)
    try:
        out = json_front_errors(out)
    except ValueError as e:
        logging.getLogger("ray.serve").warning("strata: HAProxy keeps its text/plain 500 for 502-504: %s", e)
    return out


def haproxy_no_route_is_starting() -> None:
    """Serve controller callback (RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH, set by cluster/launch.py's
    front_env for the haproxy front). The controller calls it before it creates the per-node
    HAProxyManager actors, which render HAProxy's config and run it in their own processes: it swaps in a
    subclass that rewrites the template there first (``strata_haproxy_template``). On a Ray whose
    template differs it changes nothing and logs why: /health then answers HAProxy's 404 until the
    placeholder is routed (a second or two)."""
    import ray
    try:
        from ray.serve._private import controller, haproxy
        starting_instead_of_no_route(haproxy.HAPROXY_CONFIG_TEMPLATE)
    except (ImportError, AttributeError, ValueError) as e:
        logging.getLogger("ray.serve").warning("strata: HAProxy keeps its no-route 404: %s", e)
        return
    base = haproxy.HAProxyManager.__ray_actor_class__

    class StrataHAProxyManager(base):
        def __init__(self, *args, **kwargs) -> None:
            # In the actor's process, before the base class renders the first config and starts HAProxy.
            from ray.serve._private import haproxy as hap
            if _NO_ROUTE_404.search(hap.HAPROXY_CONFIG_TEMPLATE):
                hap.HAPROXY_CONFIG_TEMPLATE = strata_haproxy_template(hap.HAPROXY_CONFIG_TEMPLATE)
            super().__init__(*args, **kwargs)

    # Ray's tools (`ray list actors`, Serve's own checks) know the proxies by this class name.
    StrataHAProxyManager.__name__ = StrataHAProxyManager.__qualname__ = "HAProxyManager"
    controller.HAProxyManager = ray.remote(num_cpus=0)(StrataHAProxyManager)
