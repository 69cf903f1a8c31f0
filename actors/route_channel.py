"""The route channel: the ingress replicas ask the router actor's ``route`` over ZMQ, beside Ray (no Ray here).

    ingress replica: RouteClient (DEALER, one per replica) --[req_id, keys, prompt_len, avoid]-->
        RouteServer (ROUTER, bound on the router's node; a thread of the router actor)
        --[req_id, ok, payload]--> the request's future

Why: every request asks the router once, and a Ray actor call costs ~1 ms of round trip and ~0.3 ms of
CPU on each side (the router's own decision costs ~0.05 ms); a ZMQ round trip between two processes costs
~0.08 ms. The router actor stays the index's one authority: the channel is only another door to the same
``route`` (the server calls it under the actor's lock), and the Ray call stays the fallback, so nothing
here has to be reliable: a request whose answer does not come (a timeout, the router's connection lost)
is asked again over Ray by the caller, which then re-asks the endpoint (a restarted router binds anew).

Wire (frames after the ROUTER's routing id): one msgpack array each way. Request ``[req_id, keys,
prompt_len, avoid]``; reply ``[req_id, true, [prefill, decode, cached_pages, by_tier]]`` (the ``Route``
fields) or ``[req_id, false, [error_kind, message]]``; ``error_kind`` ``NoWorkerError`` (the router has no
worker for it yet: the caller retries as over Ray) comes back as that exception, any other as RouterError.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from typing import Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from actors.prefix_router import Route
from actors.routing import NoWorkerError
from actors.zmq_sockets import bind_random, close_monitored

log = logging.getLogger("strata.route_channel")

NO_WORKER = "NoWorkerError"
_POLL_MS = 100    # the server thread looks at its stop flag at least this often


class RouterError(RuntimeError):
    """The router failed a route for another reason than having no worker (its message says which)."""


class ChannelDown(Exception):
    """No answer over the channel (a timeout, the connection to the router lost, the client closed):
    the caller asks over Ray instead."""


class _Request(msgspec.Struct, array_like=True):
    req_id: int
    keys: list[int]
    prompt_len: int
    avoid: list[str] | None


class _RouteWire(msgspec.Struct, array_like=True):
    """A ``Route`` on the wire, typed so that a reply of another shape fails to decode, loudly."""
    prefill: str
    decode: str | None
    cached_pages: int
    by_tier: dict[str, int]


_encoder = msgspec.msgpack.Encoder()
_req_decoder = msgspec.msgpack.Decoder(_Request)
_reply_decoder = msgspec.msgpack.Decoder(tuple[int, bool, list])


def encode_request(req_id: int, keys: list[int], prompt_len: int, avoid: list[str] | None) -> bytes:
    return _encoder.encode((req_id, keys, prompt_len, avoid))


def answer(route: Callable[[list[int], int, list[str] | None], Route], payload: bytes) -> bytes:
    """The reply to one request payload: ``route``'s answer, or its error by kind (a request that does
    not decode is a ValueError, answered like any other error: its id, when readable, lets the client
    fail that request at once)."""
    try:
        req = _req_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return _encoder.encode((_req_id_of(payload), False, ("ValueError", f"bad route request: {e}")))
    try:
        r = route(req.keys, req.prompt_len, req.avoid)
    except NoWorkerError as e:
        return _encoder.encode((req.req_id, False, (NO_WORKER, str(e))))
    except Exception as e:  # noqa: BLE001 - its kind and message go back to the caller
        return _encoder.encode((req.req_id, False, (type(e).__name__, str(e))))
    return _encoder.encode((req.req_id, True, (r.prefill, r.decode, r.cached_pages, r.by_tier)))


def _req_id_of(payload: bytes) -> int:
    try:
        got = msgspec.msgpack.decode(payload)
        return got[0] if isinstance(got, list) and got and isinstance(got[0], int) else -1
    except msgspec.DecodeError:
        return -1


def decode_reply(payload: bytes, where: str) -> tuple[int, Route | Exception]:
    """``(req_id, Route or the exception to raise)``; ``where`` names the router in errors."""
    req_id, ok, payload = _reply_decoder.decode(payload)
    if ok:
        r = msgspec.convert(payload, _RouteWire)
        return req_id, Route(r.prefill, r.decode, r.cached_pages, r.by_tier)
    kind, msg = msgspec.convert(payload, tuple[str, str])
    if kind == NO_WORKER:
        return req_id, NoWorkerError(msg)
    return req_id, RouterError(f"router at {where}: {kind}: {msg}")


class RouteServer:
    """The router's end: a ROUTER bound on ``host`` (a free port; ``endpoint`` says where) and one thread
    that owns the socket and answers each request with ``route(keys, prompt_len, avoid)`` (the actor's
    locked ``route``). The ROUTER never blocks on a send (no high-water mark); a client that is gone is
    dropped by ZMQ."""

    def __init__(self, host: str, route: Callable[[list[int], int, list[str] | None], Route]) -> None:
        self._route = route
        self._ctx = zmq.Context(1)
        try:
            self._sock, self.endpoint = bind_random(self._ctx, zmq.ROUTER, host)
        except BaseException:
            self._ctx.term()
            raise
        self._closed = threading.Event()
        self.answered = 0   # requests answered (tests, profiling)
        self._thread = threading.Thread(target=self._serve, name="strata-route-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sock = self._sock
        try:
            while not self._closed.is_set():
                if not sock.poll(_POLL_MS):
                    continue
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) != 2:
                        log.warning("route channel: unexpected message of %d frames", len(frames))
                        continue
                    sock.send_multipart((frames[0], answer(self._route, frames[1])))
                    self.answered += 1
        except zmq.ZMQError as e:
            if not self._closed.is_set():
                log.error("route channel %s: server stopped: %s", self.endpoint, e)
        finally:
            sock.close(linger=0)   # closed by the thread that owns it

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join(timeout=2)
        self._ctx.term()


class RouteClient:
    """An ingress replica's end: a DEALER whose reader task (on the event loop that opened it) resolves
    each request's future by its id. The connection's loss (the router's process gone: its socket closed
    or refusing) fails every pending request at once with ChannelDown and closes the client, rather than
    letting each wait out its timeout."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, timeout: float = 2.0) -> None:
        self.endpoint, self.timeout = endpoint, timeout
        self._sock = ctx.socket(zmq.DEALER)
        for opt, v in ((zmq.LINGER, 0), (zmq.RCVHWM, 0), (zmq.SNDHWM, 0)):
            self._sock.setsockopt(opt, v)
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        self._sock.connect(endpoint)
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self.loop = asyncio.get_running_loop()   # the reader's: a client serves requests on this loop only
        self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._watch())]
        self.closed = False
        self.why = ""   # why it closed

    async def route(self, keys: list[int], prompt_len: int, avoid: list[str] | None) -> Route:
        """The router's answer; NoWorkerError / RouterError as the router said; ChannelDown when none
        came within ``timeout`` or the channel is closed."""
        if self.closed:
            raise ChannelDown(f"route channel {self.endpoint} is closed: {self.why}")
        rid = next(self._ids)
        fut = self._pending[rid] = self.loop.create_future()
        try:
            await self._sock.send(encode_request(rid, keys, prompt_len, avoid), copy=False)
            async with asyncio.timeout(self.timeout):
                got = await fut
        except TimeoutError:
            raise ChannelDown(f"route channel {self.endpoint}: no answer in {self.timeout:g}s") from None
        except zmq.ZMQError as e:
            raise ChannelDown(f"route channel {self.endpoint}: {e}") from None
        finally:
            self._pending.pop(rid, None)
        if isinstance(got, Exception):
            raise got
        return got

    async def _read(self) -> None:
        try:
            while True:
                payload = await self._sock.recv(copy=True)
                try:
                    rid, got = decode_reply(payload, self.endpoint)
                except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:   # a bug, said loudly
                    log.error("route channel %s: unreadable reply: %s", self.endpoint, e)
                    continue   # its request times out, then goes over Ray
                fut = self._pending.get(rid)
                if fut is not None and not fut.done():
                    fut.set_result(got)
        except (asyncio.CancelledError, zmq.ZMQError):
            return
        except Exception as e:  # noqa: BLE001 - the channel is unusable: its requests go over Ray
            log.exception("route channel %s: reader failed", self.endpoint)
            self._lose(f"reader failed: {e!r}")

    async def _watch(self) -> None:
        try:
            while True:
                ev = parse_monitor_message(await self._monitor.recv_multipart())
                if ev["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECT_RETRIED):
                    self._lose("the router's connection is lost" if ev["event"] == zmq.EVENT_DISCONNECTED
                               else "the router's endpoint refuses connections")
                    return
        except (asyncio.CancelledError, zmq.ZMQError):
            return

    def _lose(self, why: str) -> None:
        if self.closed:
            return
        self.why = why
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ChannelDown(f"route channel {self.endpoint}: {why}"))
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.why = self.why or "closed"
        for t in self._tasks:
            try:
                t.cancel()
            except RuntimeError:   # its loop is closed already: so is the task
                pass
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ChannelDown(f"route channel {self.endpoint}: closed"))
        close_monitored(self._sock, self._monitor)


__all__ = ["ChannelDown", "RouteClient", "RouteServer", "RouterError", "answer", "decode_reply", "encode_request"]
