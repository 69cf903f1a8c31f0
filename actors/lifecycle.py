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


def strata_haproxy_template(template: str) -> str:
    """Ray's HAProxy config template as strata runs it: ``starting_instead_of_no_route``, HAProxy's side
    listeners bound where its HTTP front is (loopback for `make run`, every interface on a pod), and
    server connections reused only where a dying replica cannot drop a client's request silently."""
    out = starting_instead_of_no_route(template)
    for old, new in (*_ALL_INTERFACES, _REUSE):
        out = out.replace(old, new)
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
