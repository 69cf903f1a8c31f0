"""bench/overhead.py --timeline only (imported by this folder's sitecustomize when
$STRATA_OVERHEAD_TIMELINE names a folder): marks each point of a request's way through a server process with
the time (``time.perf_counter``, CLOCK_MONOTONIC: one clock for every process of the machine), written to
<folder>/<pid>.txt as "<mark> <seconds>" lines twice a second. The marks are wrappers put on the functions
as their modules finish importing (an import hook, so a bound method taken at start-up is already the
wrapped one). Production code never imports it."""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import threading
import time

_DIR = os.environ.get("STRATA_OVERHEAD_TIMELINE", "")
_MAX = 400_000
_marks: list[tuple[str, float]] = []


def mark(name: str) -> None:
    if len(_marks) < _MAX:
        _marks.append((name, time.perf_counter()))


def _writer() -> None:
    path = os.path.join(_DIR, f"{os.getpid()}.txt")
    written = 0
    while True:
        time.sleep(0.5)
        if len(_marks) == written:
            continue
        written = len(_marks)
        try:
            with open(path + ".tmp", "w") as f:
                f.write("\n".join(f"{n} {t:.7f}" for n, t in _marks[:written]))
            os.replace(path + ".tmp", path)
        except OSError:
            pass


def _around(fn, before: str, after: str | None = None):
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapped_async(*a, **kw):
            mark(before)
            try:
                return await fn(*a, **kw)
            finally:
                if after:
                    mark(after)
        return wrapped_async

    @functools.wraps(fn)
    def wrapped(*a, **kw):
        mark(before)
        try:
            return fn(*a, **kw)
        finally:
            if after:
                mark(after)
    return wrapped


def _lifecycle(m) -> None:
    """The first and last points of the ingress replica's own code: the ASGI middleware uvicorn calls
    first (Serve's request wrapper, FastAPI and strata's app come after it), and the answer's two sends."""
    orig = m.NoRouteIsStarting.__call__

    async def call(self, scope, receive, send):
        if scope.get("type") != "http":
            return await orig(self, scope, receive, send)
        mark("ingress: HTTP request in (uvicorn parsed it)")

        async def send_marked(message):
            if message["type"] == "http.response.start":
                mark("ingress: answer's headers out")
            elif not message.get("more_body", False):
                mark("ingress: answer's body out")
            await send(message)
        return await orig(self, scope, receive, send_marked)
    m.NoRouteIsStarting.__call__ = call


def _http_body(m) -> None:
    m.BodyLimit.__call__ = _around(m.BodyLimit.__call__, "ingress: past Serve's wrapper and FastAPI's outer middleware")


def _sglang(m) -> None:
    m.SGLangAdapter.generate = _around(m.SGLangAdapter.generate, "ingress: /generate handler (body parsed, validated)",
                                       "ingress: answer built (handler returns)")


def _token_channel(m) -> None:
    m.ChannelClient._send_request = _around(m.ChannelClient._send_request, "ingress: request sent to the worker")
    m.decode_items = _around(m.decode_items, "ingress: items received")
    m.ChannelServer.send_step = _around(m.ChannelServer.send_step, "worker: items sent", "worker: their send returned")
    m.ChannelServer._handle = _around(m.ChannelServer._handle, "worker: request read")


def _engine(m) -> None:
    m.Engine.step = _around(m.Engine.step, "worker: engine step starts", "worker: engine step ends")


_PATCHES = {"actors.lifecycle": _lifecycle, "actors.http_body": _http_body, "actors.sglang_api": _sglang,
            "actors.token_channel": _token_channel, "engine.engine": _engine}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, patch) -> None:
        self.inner, self.patch = inner, patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, patch)
        return spec


def install() -> None:
    sys.meta_path.insert(0, _Finder())
    threading.Thread(target=_writer, name="overhead-timeline", daemon=True).start()
