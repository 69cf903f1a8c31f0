"""The route channel: the ingress replicas ask the router actor's ``route``, and the workers send it their
``report``, over ZMQ, beside Ray (no Ray here).

    ingress replica: RouteClient (DEALER, one per replica) --[req_id, keys, prompt_len, avoid]-->
        RouteServer (ROUTER, bound on the router's node; a thread of the router actor)
        --[req_id, ok, payload]--> the request's future
    worker: ReportClient (DEALER, its report thread's) --[REPORT, report]--> RouteServer --[req_id, ok,
        [ignored, resync]]--> the report thread, which waits for it

Why: every request asks the router once, and a Ray actor call costs ~1 ms of round trip and ~0.3 ms of
CPU on each side (the router's own decision costs ~0.05 ms); a ZMQ round trip between two processes costs
~0.08 ms. The router actor stays the index's one authority: the channel is only another door to the same
``route`` (the server calls it under the actor's lock), and the Ray call stays the fallback, so nothing
here has to be reliable: a request whose answer does not come (a timeout, the router's connection lost)
is asked again over Ray by the caller, which then re-asks the endpoint (a restarted router binds anew).

Reports: every worker reports every 50 ms (its load, liveness and where its KV-event streams stand, and
the answer says whether to resend fresh or publish a snapshot). Over Ray that was a call every 50 ms per
worker whose machinery (serialisation, the actor's executor) cost ~2 ms of CPU between the two processes
each time, idle or not: 6% of a loaded colocated cluster's requests per second. The report thread waits
for its answer as it waited for the Ray call's; when none comes (``timeout``, or the router's connection
seen lost) it is ChannelDown and the worker reports over Ray, then asks where the channel is again.

Wire (frames after the ROUTER's routing id): one msgpack array each way. Request ``[req_id, keys,
prompt_len, avoid, local]`` (``local`` may be left off: true); reply ``[req_id, true, [prefill, decode,
cached_pages, by_tier, alone]]`` (the ``Route`` fields) or ``[req_id, false, [error_kind, message]]``;
``error_kind`` ``NoWorkerError`` (the router has no worker for it yet: the caller retries as over Ray) comes
back as that exception, any other as RouterError.
A report is two frames, ``REPORT`` then ``[req_id, worker, role, load, fresh, stream, l3]`` (``load`` a
WorkerLoad's fields in order; the streams ``[[topic, pub, replay], seq]`` or nil); its reply ``[req_id,
true, [ignored, resync]]`` or an error as above.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from typing import Callable, Optional

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from actors.prefix_router import ReportReply, Route
from actors.routing import NoWorkerError
from actors.zmq_sockets import bind_random, close_monitored
from engine.worker_load import WorkerLoad
from storage.kv_events.publisher import StreamPosition

log = logging.getLogger("strata.route_channel")

NO_WORKER = "NoWorkerError"
REPORT = b"report"   # the kind frame of a worker's report (a route request has none)
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
    local: bool = True


class _RouteWire(msgspec.Struct, array_like=True):
    """A ``Route`` on the wire, typed so that a reply of another shape fails to decode, loudly."""
    prefill: str
    decode: str | None
    cached_pages: int
    by_tier: dict[str, int]
    alone: bool = False


class _Report(msgspec.Struct, array_like=True):
    req_id: int
    worker: str
    role: str
    load: WorkerLoad
    fresh: bool
    stream: Optional[StreamPosition]
    l3: Optional[StreamPosition]


Report = Callable[[str, str, WorkerLoad, bool, Optional[StreamPosition], Optional[StreamPosition]], ReportReply]
"""The router actor's locked ``report(worker, role, load, fresh, stream, l3)``."""

_encoder = msgspec.msgpack.Encoder()
_req_decoder = msgspec.msgpack.Decoder(_Request)
_report_decoder = msgspec.msgpack.Decoder(_Report)
_reply_decoder = msgspec.msgpack.Decoder(tuple[int, bool, list])


def encode_request(req_id: int, keys: list[int], prompt_len: int, avoid: list[str] | None,
                   local: bool = True) -> bytes:
    return _encoder.encode((req_id, keys, prompt_len, avoid, local))


def answer(route: Callable[[list[int], int, list[str] | None, bool], Route], payload: bytes) -> bytes:
    """The reply to one request payload: ``route``'s answer, or its error by kind (a request that does
    not decode is a ValueError, answered like any other error: its id, when readable, lets the client
    fail that request at once)."""
    try:
        req = _req_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return _encoder.encode((_req_id_of(payload), False, ("ValueError", f"bad route request: {e}")))
    try:
        r = route(req.keys, req.prompt_len, req.avoid, req.local)
    except NoWorkerError as e:
        return _encoder.encode((req.req_id, False, (NO_WORKER, str(e))))
    except Exception as e:  # noqa: BLE001 - its kind and message go back to the caller
        return _encoder.encode((req.req_id, False, (type(e).__name__, str(e))))
    return _encoder.encode((req.req_id, True, (r.prefill, r.decode, r.cached_pages, r.by_tier, r.alone)))


def answer_report(report: Report, payload: bytes) -> bytes:
    """The reply to one report payload: ``[req_id, true, [ignored, resync]]``, or its error by kind."""
    try:
        r = _report_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return _encoder.encode((_req_id_of(payload), False, ("ValueError", f"bad report: {e}")))
    try:
        got = report(r.worker, r.role, r.load, r.fresh, r.stream, r.l3)
    except Exception as e:  # noqa: BLE001 - its kind and message go back to the worker
        return _encoder.encode((r.req_id, False, (type(e).__name__, str(e))))
    return _encoder.encode((r.req_id, True, (got.ignored, got.resync)))


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
        return req_id, Route(r.prefill, r.decode, r.cached_pages, r.by_tier, r.alone)
    kind, msg = msgspec.convert(payload, tuple[str, str])
    if kind == NO_WORKER:
        return req_id, NoWorkerError(msg)
    return req_id, RouterError(f"router at {where}: {kind}: {msg}")


class RouteServer:
    """The router's end: a ROUTER bound on ``host`` (a free port; ``endpoint`` says where) and one thread
    that owns the socket and answers each request with ``route(keys, prompt_len, avoid, local)`` and each report
    with ``report(...)`` (the actor's locked methods; without ``report``, reports are answered with an
    error). The ROUTER never blocks on a send (no high-water mark); a client that is gone is dropped by
    ZMQ."""

    def __init__(self, host: str, route: Callable[[list[int], int, list[str] | None], Route],
                 report: Optional[Report] = None) -> None:
        self._route, self._report = route, report
        self._ctx = zmq.Context(1)
        try:
            self._sock, self.endpoint = bind_random(self._ctx, zmq.ROUTER, host)
        except BaseException:
            self._ctx.term()
            raise
        self._closed = threading.Event()
        self.answered = 0   # requests answered (tests, profiling)
        self.reports = 0    # reports answered
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
                    if len(frames) == 2:
                        sock.send_multipart((frames[0], answer(self._route, frames[1])))
                        self.answered += 1
                    elif len(frames) == 3 and frames[1] == REPORT:
                        sock.send_multipart((frames[0], answer_report(self._no_report if self._report is None
                                                                      else self._report, frames[2])))
                        self.reports += 1
                    else:
                        log.warning("route channel: unexpected message of %d frames", len(frames))
        except zmq.ZMQError as e:
            if not self._closed.is_set():
                log.error("route channel %s: server stopped: %s", self.endpoint, e)
        finally:
            sock.close(linger=0)   # closed by the thread that owns it

    @staticmethod
    def _no_report(*_a) -> ReportReply:
        raise RouterError("this route channel takes no reports")

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

    async def route(self, keys: list[int], prompt_len: int, avoid: list[str] | None, local: bool = True) -> Route:
        """The router's answer; NoWorkerError / RouterError as the router said; ChannelDown when none
        came within ``timeout`` or the channel is closed."""
        if self.closed:
            raise ChannelDown(f"route channel {self.endpoint} is closed: {self.why}")
        rid = next(self._ids)
        fut = self._pending[rid] = self.loop.create_future()
        try:
            await self._sock.send(encode_request(rid, keys, prompt_len, avoid, local), copy=False)
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


class ReportClient:
    """A worker's end for its reports: a DEALER that its report thread alone uses, blocking for each
    answer. No answer within ``timeout``, or the router's connection seen lost meanwhile, is ChannelDown
    (and the client is closed: the caller reports over Ray and opens a new one at the endpoint the router
    names then)."""

    def __init__(self, endpoint: str, timeout: float = 2.0) -> None:
        self.endpoint, self.timeout = endpoint, timeout
        self._ctx = zmq.Context(1)
        self._sock = self._ctx.socket(zmq.DEALER)
        for opt, v in ((zmq.LINGER, 0), (zmq.RCVHWM, 0), (zmq.SNDHWM, 0)):
            self._sock.setsockopt(opt, v)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        self._sock.connect(endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._ids = itertools.count()
        self.closed = False

    def report(self, worker: str, role: str, load: WorkerLoad, fresh: bool, stream: Optional[StreamPosition],
               l3: Optional[StreamPosition]) -> ReportReply:
        """The router's answer; RouterError for its error; ChannelDown when none came."""
        if self.closed:
            raise ChannelDown(f"route channel {self.endpoint} is closed")
        rid = next(self._ids)
        try:
            self._sock.send_multipart((REPORT, _encoder.encode(_Report(rid, worker, role, load, fresh, stream, l3))))
            got = self._wait(rid)
        except zmq.ZMQError as e:
            self.close()
            raise ChannelDown(f"route channel {self.endpoint}: {e}") from None
        if isinstance(got, Exception):
            raise got
        return got

    def _wait(self, rid: int) -> ReportReply | Exception:
        deadline = time.monotonic() + self.timeout
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(self._poller.poll(max(1, int(left * 1000))))
            if self._monitor in ready:
                ev = parse_monitor_message(self._monitor.recv_multipart())
                if ev["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECT_RETRIED):
                    self.close()
                    raise ChannelDown(f"route channel {self.endpoint}: the router's connection is lost")
            if self._sock in ready:
                try:
                    req_id, ok, payload = _reply_decoder.decode(self._sock.recv())
                    if req_id != rid:
                        continue   # the answer to an earlier report that timed out
                    if ok:
                        return ReportReply(*msgspec.convert(payload, tuple[bool, bool]))
                    kind, msg = msgspec.convert(payload, tuple[str, str])
                except (msgspec.DecodeError, msgspec.ValidationError) as e:   # a bug, said loudly
                    log.error("route channel %s: unreadable report reply: %s", self.endpoint, e)
                    continue
                return RouterError(f"router at {self.endpoint}: {kind}: {msg}")
        self.close()
        raise ChannelDown(f"route channel {self.endpoint}: no answer to a report in {self.timeout:g}s")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        close_monitored(self._sock, self._monitor)
        self._ctx.term()


__all__ = ["ChannelDown", "ReportClient", "RouteClient", "RouteServer", "RouterError", "answer", "answer_report",
           "decode_reply", "encode_request"]
