"""The token channel: a worker's stream items to the ingress replicas, one ZMQ message per engine step and
ingress, beside Ray (no Ray here).

    engine thread --(one step's items)--> ChannelServer (ROUTER, bound on the worker's node)
        --(one message per ingress per step)--> ChannelClient (DEALER, one per worker in each ingress
        replica) --(demultiplexed)--> one asyncio queue per request

The tokens do not ride on Ray: a Ray streamed object per token costs ~1 ms of CPU in the worker and more
in the ingress (pickled, stored, one RPC each), a step's items for every request of one ingress cost one
message here. A non-streamed request's items are held on the worker and leave merged, at its end or every
WHOLE_SEND_TOKENS tokens or WHOLE_SEND_SECONDS (engine/async_engine.py), much as SGLang's scheduler sends
such a request's output: its reader wants only the whole answer. Requests come two ways:

* over the channel itself (``ChannelClient.submit``): a PUSH beside the DEALER sends ``[SUBMIT, identity,
  key, request]`` to the worker's PULL, which a colocated worker's engine thread reads itself between
  its steps and while idle (``ChannelServer.requests``, engine/async_engine.py ``set_inbox``: one thread
  woken per request; a server built with ``read_requests``, a prefill or decode worker's, hands them over
  from a thread of its own instead), and ``on_request`` queues it to the engine; ``[ABORT, identity,
  key]`` stops it. No Ray call: a Ray actor call costs ~1 ms of latency and ~0.3 ms
  of CPU on each side, a ZMQ hop ~0.1 ms. What Ray's call gave is kept otherwise: a request the worker
  refuses comes back as ``[ERROR, payload]`` and is raised as its kind (ValueError, MemoryError); a worker
  that dies drops the DEALER's connection (or stops answering its heartbeats), which fails every open
  request of that client at once (``ChannelLost``).
* a P/D request, over its prefill worker's channel (``ChannelClient.handoff``): ``[HANDOFF, identity,
  key, request]`` names the decode worker's lease and where the decode half's items go (the same
  ingress's channel to the decode worker, under a key of that channel, and that channel's request
  endpoint). The prefill worker reserves the lease on the decode worker over that worker's channel too
  (``ChannelClient.reserve``: ``[RESERVE, identity, key, pickle(Reserve)]`` to its request endpoint from
  the prefill worker's own DEALER to it, answered ``[RESERVED, pickle((key, Destination))]`` or as a
  refused request's ERROR), while it computes the prompt. It answers the first token on its own channel,
  then hands the decode half to the decode worker itself over the decode worker's request endpoint
  (``LeasedSender``: ``[LEASED,
  identity, key, request, *buffers]``, the ingress's identity and key, so the decode worker's items go
  straight to the ingress; the receipt's KV, for ray_object, rides out of band in the buffers) and says
  ``[DONE, key]``: handed on. No Ray call on the way: a worker-to-worker Ray call cost ~2 ms of the
  prefill worker's CPU and ~1 ms of the decode worker's per request (py-spy, session 21), a ZMQ message a
  fraction of that. What the calls gave is kept otherwise: a refused reserve (no room: MemoryError) is
  raised as its kind on the prefill worker; the decode worker's refusal of the decode half (a lease gone,
  a bad receipt) is an ERROR on its channel to the ingress; a decode worker that dies drops both channels;
  the client that leaves makes the ingress ABORT both halves (an ABORT that overtakes its LEASED refuses
  it when it comes).
* through a Ray call per request (``WorkerActor.submit_leased`` from a driver), which returns when the
  request is over: a worker that dies fails that call, cancelling it aborts the request.

Handshake: a client connects and says HELLO with its routing id; the server records the id and answers
ACK. Only then does the ingress send requests naming that id (``route`` refuses an id it never heard
from, ``StaleChannel``): a ROUTER drops what it sends to a peer it does not know, so an item can never go
to a connection that is not set up yet, and a worker that restarted (a new process, a new server) says
so on the first request instead of sending its items nowhere.

Wire (frames after the ROUTER's routing id): ``[HELLO]`` / ``[ACK]``; ``[ITEMS, payload]``, payload a
msgpack array of ``[key, *StreamItem fields]`` in the dataclass's order (TokenLogprob as arrays), or
``[PICKLED, payload]`` for a batch msgpack cannot encode (a value of an unexpected type); ``[ERROR,
payload]``, msgpack ``[key, kind, message, worker]`` (``worker``: the peer a PeerFailed names, else
""); ``[DONE, payload]``, msgpack ``key``: a handed-off request's decode half is handed on; ``[RESERVED,
payload]``, pickle ``(key, Destination)``: a reserve's leased pages. Requests (PUSH ->
PULL): ``[SUBMIT, identity, key, pickle((prompt ids, SamplingParams, whole))]`` (pickled as Ray would:
both ends are the cluster's own processes; ``whole``: a non-streamed request, whose items the worker sends
merged), ``[HANDOFF, identity, key, pickle(Handoff)]``, ``[LEASED, identity, key, pickle((prompt ids,
lease id, Receipt, SamplingParams, whole)), *out-of-band buffers]``, ``[RESERVE, identity, key,
pickle(Reserve)]``, ``[ABORT, identity, key]``.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import select
import threading
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, NamedTuple

import msgspec
import zmq
import zmq.asyncio
import zmq.utils.monitor

from actors.handoff import PeerFailed, Reservation
from actors.zmq_sockets import bind_random, close_monitored
from engine.stream import StreamItem
from engine.sampling import SamplingParams, TokenLogprob
from storage.transfer import TransferError

log = logging.getLogger("strata.token_channel")

HELLO, ACK, ITEMS, PICKLED, ERROR, DONE, RESERVED = b"H", b"A", b"I", b"P", b"E", b"R", b"W"
SUBMIT, HANDOFF, LEASED, ABORT, RESERVE = b"S", b"D", b"L", b"X", b"V"
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 1000, 5000
"""A client pings its worker's socket this often and counts it gone when no answer comes this long (a
node lost without its TCP connections closing). libzmq's own I/O thread answers, so a worker busy in
Python does not miss them."""
ERROR_KINDS: dict[str, type[Exception]] = {"ValueError": ValueError, "MemoryError": MemoryError,
                                          "TransferError": TransferError}
"""The kinds a refused request is raised as at the ingress (the HTTP layer's 4xx, a failed KV transfer's
503); any other is a RuntimeError, as a Ray call's would be, but for StaleChannel and PeerFailed (which
keeps the worker it names)."""
_HELLO_POLL_S = 0.1    # the server's hello thread: at most this late when a send consumed the FD's edge


class StaleChannel(Exception):
    """A request named a channel this worker never heard from: the worker restarted (its server is new)
    or the client's connection is gone. The ingress reconnects and submits again."""


class ChannelLost(Exception):
    """A request's call said it is over but its last item never came on the channel."""


class Handoff(NamedTuple):
    """A P/D request as its prefill worker receives it over the channel: the prompt, the lease it reserves
    on the decode worker (``res``, named by the ingress), and where the decode half's items go:
    ``decode_channel`` (the ingress's routing id on the decode worker's channel) under ``decode_key``;
    ``decode_requests``: that channel's request endpoint, where the prefill worker reserves the lease
    (RESERVE) and sends the decode half (LEASED); ``decode_endpoint``: that channel's own address, where
    the reserve's answer comes from ("": reserve with a Ray call)."""
    ids: list[int]
    params: SamplingParams
    whole: bool
    res: Reservation
    decode_channel: bytes
    decode_key: int
    decode_requests: str
    decode_endpoint: str = ""


class Leased(NamedTuple):
    """A handed-off request's decode half as its decode worker receives it (LEASED)."""
    ids: list[int]
    lease_id: str
    receipt: Any          # storage.transfer.Receipt (its ray_object payload's KV out of band)
    params: SamplingParams
    whole: bool


class Reserve(NamedTuple):
    """A lease asked of a decode worker over its channel (RESERVE): ``WorkerActor.reserve``'s arguments."""
    prompt_len: int
    sender: str
    lease_id: str


class Route(NamedTuple):
    """Where one request's items go: the client's routing id and the request's key on that client."""
    channel: bytes
    key: int


class _Wire(msgspec.Struct, array_like=True):
    """One StreamItem on the wire, every field typed so that it decodes back exactly (TokenLogprob as a
    NamedTuple with tuple ``top``; ``prompt_logprobs`` entries may be None)."""
    key: int
    rid: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    error: str | None
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob | None] | None
    matched_stop: int | str | None
    held_s: float = 0.0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[_Wire])


def encode_items(items: Iterable[tuple[int, StreamItem]]) -> tuple[bytes, bytes]:
    """(kind, payload) of one message of ``(key, item)`` pairs: msgpack, or pickle where msgpack cannot
    (a field of a type the engine does not normally produce)."""
    items = list(items)
    rows = [(k, i.rid, i.token_ids, i.finished, i.finish_reason, i.prompt_tokens, i.cached_tokens,
             i.cached_tokens_by_tier, i.error, i.logprobs, i.prompt_logprobs, i.matched_stop, i.held_s)
            for k, i in items]
    try:
        return ITEMS, _encoder.encode(rows)
    except (TypeError, msgspec.EncodeError):
        return PICKLED, pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)


def decode_items(kind: bytes, payload: bytes) -> list[tuple[int, StreamItem]]:
    if kind == PICKLED:
        return pickle.loads(payload)
    return [(w.key, StreamItem(w.rid, w.token_ids, w.finished, w.finish_reason, w.prompt_tokens, w.cached_tokens,
                               w.cached_tokens_by_tier, w.error, w.logprobs, w.prompt_logprobs, w.matched_stop,
                               w.held_s))
            for w in _decoder.decode(payload)]


class ChannelServer:
    """A worker's end: a ROUTER bound on ``host`` (a free port); ``endpoint`` says where.

    ``send_step`` is called by the engine thread once per step with that step's routed items and sends one
    message per client at once (the ROUTER never blocks: no high-water mark; a client that is gone is
    dropped by ZMQ). A small thread answers the clients' hellos. The socket is shared by the two threads
    under a lock (ZMQ sockets may change threads across a full barrier), as the KV-event publisher does."""

    def __init__(self, host: str, on_request: Callable[[Route, Any, Any, bool], None] | None = None,
                 on_abort: Callable[[Route], None] | None = None,
                 on_handoff: Callable[[Route, Handoff], None] | None = None,
                 on_leased: Callable[[Route, Leased], None] | None = None,
                 on_reserve: Callable[[Route, Reserve], None] | None = None, read_requests: bool = True) -> None:
        self._ctx = zmq.Context(1)
        try:
            self._sock, self.endpoint = bind_random(self._ctx, zmq.ROUTER, host, ((zmq.ROUTER_HANDOVER, 1),))
        except BaseException:
            self._ctx.term()
            raise
        self._lock = threading.Lock()
        self._peers: set[bytes] = set()
        self._closed = threading.Event()
        self.sent_messages = 0   # messages of items sent (tests, profiling)
        self._thread = threading.Thread(target=self._serve_hellos, name="strata-token-channel", daemon=True)
        self._thread.start()
        # Requests over the channel: a PULL of its own, so a request never waits on the ROUTER's shared
        # socket and its lock. Read by its own thread (blocked in recv, without the GIL), or, without
        # ``read_requests``, by one thread of the owner's (``requests``: a worker's engine thread, which then
        # is the only thread a request wakes) that closes it too.
        self.on_request, self.on_abort, self.on_handoff = on_request, on_abort, on_handoff
        self.on_leased, self.on_reserve = on_leased, on_reserve
        self.requests_endpoint: str | None = None
        self.received_requests = 0
        self._typed = {HANDOFF: (Handoff, on_handoff), LEASED: (Leased, on_leased), RESERVE: (Reserve, on_reserve)}
        self._req_thread: threading.Thread | None = None
        self.requests: _Requests | None = None
        if on_request is not None:
            self._pull, self.requests_endpoint = bind_random(self._ctx, zmq.PULL, host)
            if read_requests:
                self._req_thread = threading.Thread(target=self._serve_requests, name="strata-token-requests",
                                                    daemon=True)
                self._req_thread.start()
            else:
                self.requests = _Requests(self)

    def route(self, channel: bytes, key: int) -> Route:
        """The route of a request from the client ``channel``; StaleChannel if it never said hello here."""
        if channel not in self._peers:
            raise StaleChannel(f"token channel {channel.hex()} is not connected to {self.endpoint}")
        return Route(channel, key)

    def send_step(self, routed: list[tuple[Route, StreamItem]]) -> None:
        """One step's items, in order: one message per client."""
        by_client: dict[bytes, list[tuple[int, StreamItem]]] = {}
        for r, item in routed:
            by_client.setdefault(r.channel, []).append((r.key, item))
        msgs = [(ch, *encode_items(items)) for ch, items in by_client.items()]
        with self._lock:
            if self._closed.is_set():
                return
            for m in msgs:
                self._sock.send_multipart(m, copy=False)
            self.sent_messages += len(msgs)

    def send_error(self, route: Route, e: BaseException) -> None:
        """A request refused (at admission) or failed: its kind and message to its client, which raises it
        (a PeerFailed with the worker it names)."""
        self._send(route, ERROR, _encoder.encode([route.key, type(e).__name__, str(e)[:2000],
                                                   getattr(e, "worker", "") if isinstance(e, PeerFailed) else ""]))

    def send_reserved(self, route: Route, destination: Any) -> None:
        """A RESERVE's answer: the leased pages (storage.transfer.Destination), to the client that asked."""
        self._send(route, RESERVED, pickle.dumps((route.key, destination), protocol=pickle.HIGHEST_PROTOCOL))

    def send_done(self, route: Route) -> None:
        """A handed-off request's decode call is over (its last item is on the decode worker's channel)."""
        self._send(route, DONE, _encoder.encode(route.key))

    def _send(self, route: Route, kind: bytes, payload: bytes) -> None:
        with self._lock:
            if not self._closed.is_set():
                self._sock.send_multipart((route.channel, kind, payload), copy=False)

    def _serve_requests(self) -> None:
        try:
            while not self._closed.is_set():
                try:
                    frames = self._pull.recv_multipart()
                except zmq.ZMQError:   # the context is terminating (close)
                    return
                self._handle(frames)
        finally:   # this thread owns the socket, and close()'s term waits for it: closed on every way out
            self._pull.close(linger=0)

    def _handle(self, frames: list) -> None:
        """One request off the PULL: to its handler (the kinds that are one pickled NamedTuple each: to the
        handler of their type); one that cannot be read is refused to its sender, not dropped."""
        try:
            kind, channel, key = frames[0], frames[1], int.from_bytes(frames[2], "little")
            if kind == SUBMIT and len(frames) == 4:
                self.received_requests += 1
                route = Route(channel, key)
                try:
                    ids, params, whole = pickle.loads(frames[3])
                except Exception as e:  # noqa: BLE001 - a request that cannot be read is refused, not dropped
                    self.send_error(route, ValueError(f"request cannot be read: {e!r}"))
                    return
                self.on_request(route, ids, params, bool(whole))
            elif kind in self._typed and len(frames) >= 4 and self._typed[kind][1] is not None:
                want, handler = self._typed[kind]
                self.received_requests += 1
                route = Route(channel, key)
                try:   # (a LEASED's receipt KV comes out of band, in the frames after it)
                    x = pickle.loads(frames[3], buffers=frames[4:])
                    if not isinstance(x, want):
                        raise TypeError(f"expected a {want.__name__}, got {type(x).__name__}")
                except Exception as e:  # noqa: BLE001 - refused, not dropped: its sender waits for the answer
                    self.send_error(route, ValueError(f"request cannot be read: {e!r}"))
                    return
                handler(route, x)
            elif kind == ABORT and self.on_abort is not None:
                self.on_abort(Route(channel, key))
            else:
                log.warning("token channel: unexpected request of %d frames", len(frames))
        except Exception:  # noqa: BLE001 - one bad request must not stop the others
            log.exception("token channel: handling a request failed")

    def _serve_hellos(self) -> None:
        fd = self._sock.getsockopt(zmq.FD)
        while not self._closed.is_set():
            # The FD only says "look at the socket's events": a send on the engine thread may take that
            # signal, so the wait is short and the socket is read whenever it ends.
            select.select([fd], [], [], _HELLO_POLL_S)
            with self._lock:
                if self._closed.is_set():
                    return
                while self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    frames = self._sock.recv_multipart()
                    if len(frames) == 2 and frames[1] == HELLO:
                        self._peers.add(frames[0])
                        self._sock.send_multipart((frames[0], ACK))
                    else:
                        log.warning("token channel: unexpected message of %d frames", len(frames))

    def close(self) -> None:
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            self._sock.close(linger=0)
        self._thread.join(timeout=2)
        if self.requests is not None and not self.requests.closed:   # its reader did not close it (detach)
            self.requests.close()
        # Ends the request thread's blocking recv (ETERM), which then closes its socket; term returns once
        # it has.
        self._ctx.term()
        if self._req_thread is not None:
            self._req_thread.join(timeout=2)


class _Requests:
    """A ChannelServer's requests read by one thread of its owner's (``ChannelServer.requests``): what
    engine.async_engine's ``set_inbox`` takes. Only that thread may take and close."""

    def __init__(self, server: ChannelServer) -> None:
        self._server, self._pull = server, server._pull
        self.fd: int = self._pull.getsockopt(zmq.FD)
        self.closed = False

    def take(self) -> None:
        # The FD is edge-triggered: it signals again only once every waiting message was read.
        while not self.closed and self._pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:   # (EVENTS said a message was there: it was not whole yet)
                return
            self._server._handle(frames)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._pull.close(linger=0)


class ChannelClient:
    """An ingress replica's end of one worker's channel: a DEALER whose reader task (on the event loop
    that opened it) puts each item into its request's queue. Items of a key nobody waits for (a request
    already closed) are dropped."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, identity: bytes,
                 requests_endpoint: str | None = None) -> None:
        self.endpoint, self.identity = endpoint, identity
        self._sock = ctx.socket(zmq.DEALER)
        for opt, v in ((zmq.LINGER, 0), (zmq.RCVHWM, 0), (zmq.SNDHWM, 0), (zmq.ROUTING_ID, identity),
                       (zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS), (zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)):
            self._sock.setsockopt(opt, v)
        # The worker gone (its process dead: the connection drops; its node lost: the heartbeats stop):
        # every open request of this client fails at once.
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(endpoint)
        self._push = None
        self.requests_endpoint = requests_endpoint
        if requests_endpoint is not None:
            self._push = ctx.socket(zmq.PUSH)
            for opt, v in ((zmq.LINGER, 0), (zmq.SNDHWM, 0)):
                self._push.setsockopt(opt, v)
            self._push.connect(requests_endpoint)
        self._queues: dict[int, asyncio.Queue] = {}
        self._keys = itertools.count()
        self.loop = asyncio.get_running_loop()   # the reader's: a client serves requests on this loop only
        self._acked = self.loop.create_future()
        self._reader = asyncio.ensure_future(self._read())
        self._watcher = asyncio.ensure_future(self._watch())
        self._released = False
        self.dropped = 0   # items that came for no open request
        self.received_messages = 0
        self.closed = False

    async def ready(self, timeout: float) -> None:
        """Say hello and wait for the server's answer (asyncio.TimeoutError when none comes)."""
        await self._sock.send(HELLO)
        await asyncio.wait_for(asyncio.shield(self._acked), timeout)

    def open(self) -> tuple[int, asyncio.Queue]:
        """A new request's key and the queue its items arrive in."""
        key = next(self._keys)
        q = self._queues[key] = asyncio.Queue()
        return key, q

    def release(self, key: int) -> None:
        self._queues.pop(key, None)

    def submit(self, key: int, ids: list[int], params: Any, whole: bool = False) -> None:
        """Send request ``key`` (``open`` it first) to the worker over the channel; its items, or the error
        that refused it, or the channel's loss, come in its queue. ``whole``: its reader wants the whole
        answer only, so the worker sends its items merged (engine/async_engine.py WHOLE_SEND_TOKENS)."""
        if self._push is None:
            raise RuntimeError(f"token channel {self.endpoint}: opened without the worker's request endpoint")
        if self.closed:
            raise ChannelLost(f"token channel {self.endpoint} is closed")
        self._send_request(SUBMIT, key, (ids, params, whole))

    def handoff(self, key: int, h: Handoff) -> None:
        """Send P/D request ``key`` to its prefill worker (this channel's); its first item, or its error, or
        DONE once the decode half is handed on, come in its queue here; the decode half's items (or its
        refusal) in the queue of ``h.decode_key`` on the decode worker's channel (open both first).
        ``abort(key)`` here and ``abort(h.decode_key)`` there stop all of it."""
        self._send_request(HANDOFF, key, h)

    async def reserve(self, r: Reserve, timeout: float) -> Any:
        """Lease pages on this channel's (decode) worker: its answer, a storage.transfer.Destination. Raises
        the worker's refusal as its kind (ValueError, MemoryError, TransferError), ChannelLost when the
        worker's connection drops, asyncio.TimeoutError when no answer comes within ``timeout``."""
        key, q = self.open()
        try:
            self._send_request(RESERVE, key, r)
            x = await asyncio.wait_for(q.get(), timeout)
        finally:
            self.release(key)
        if isinstance(x, BaseException):
            raise x
        return x

    def _send_request(self, kind: bytes, key: int, request: Any) -> None:
        if self._push is None:
            raise RuntimeError(f"token channel {self.endpoint}: opened without the worker's request endpoint")
        if self.closed:
            raise ChannelLost(f"token channel {self.endpoint} is closed")
        self._push.send_multipart((kind, self.identity, key.to_bytes(8, "little"),
                                   pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)), copy=False)

    def abort(self, key: int) -> None:
        """Stop request ``key`` on the worker (its client left); a no-op for one already over."""
        if self._push is not None and not self.closed:
            self._push.send_multipart((ABORT, self.identity, key.to_bytes(8, "little")))

    async def _watch(self) -> None:
        try:
            while True:
                msg = await self._monitor.recv_multipart()
                if zmq.utils.monitor.parse_monitor_message(msg)["event"] == zmq.EVENT_DISCONNECTED:
                    break
        except (asyncio.CancelledError, zmq.ZMQError):
            return
        log.warning("token channel %s: the worker's connection dropped", self.endpoint)
        self.closed = True
        lost = ChannelLost(f"the connection to the worker's token channel {self.endpoint} dropped")
        for q in list(self._queues.values()):
            q.put_nowait(lost)

    async def _read(self) -> None:
        try:
            while True:
                frames = await self._sock.recv_multipart(copy=True)
                kind = frames[0]
                if kind == ACK:
                    if not self._acked.done():
                        self._acked.set_result(None)
                    continue
                if kind == ERROR:
                    key, name, message, *worker = msgspec.msgpack.decode(frames[1])
                    q = self._queues.get(key)
                    if q is not None:
                        q.put_nowait(remote_error(name, message, worker[0] if worker else ""))
                    continue
                if kind == DONE:
                    q = self._queues.get(msgspec.msgpack.decode(frames[1]))
                    if q is not None:
                        q.put_nowait(RETURNED)
                    continue
                if kind == RESERVED:
                    key, destination = pickle.loads(frames[1])
                    q = self._queues.get(key)
                    if q is not None:
                        q.put_nowait(destination)
                    continue
                self.received_messages += 1
                try:
                    items = decode_items(kind, frames[1])
                except msgspec.ValidationError as e:   # a field of another type than the wire's: a bug, said loudly
                    self._fail([row[0] for row in msgspec.msgpack.decode(frames[1])], e)
                    continue
                for key, item in items:
                    q = self._queues.get(key)
                    if q is None:
                        self.dropped += 1
                    else:
                        q.put_nowait(item)
        except (asyncio.CancelledError, zmq.ZMQError):
            return
        except Exception as e:   # noqa: BLE001 - a message that cannot be read: its requests fail now
            log.exception("token channel %s: reader failed", self.endpoint)
            self.closed = True
            self._fail(list(self._queues), e)

    def _fail(self, keys: list[int], e: Exception) -> None:
        for key in keys:
            q = self._queues.get(key)
            if q is not None:
                q.put_nowait(RuntimeError(f"token channel {self.endpoint}: cannot read an item: {e!r}"))

    def close(self) -> None:
        if self._released:   # (``closed`` may be set already: the connection dropped, the sockets are still ours)
            return
        self.closed = self._released = True
        try:
            self._reader.cancel()
            self._watcher.cancel()
        except RuntimeError:   # its loop is closed already: so are the reader and the watcher
            pass
        close_monitored(self._sock, self._monitor)
        if self._push is not None:
            self._push.close(linger=0)


class LeasedSender:
    """A prefill worker's end toward its decode workers' request endpoints: one PUSH per endpoint, used
    from one thread (the actor's event loop). ``send`` never blocks: a decode worker that stopped reading
    (gone, its endpoint stale) fills its socket's queue up to ``hwm`` messages, and a send past that
    raises ChannelLost, as does one after ``close``."""

    def __init__(self, hwm: int = 1000) -> None:
        self._ctx = zmq.Context(1)
        self._socks: dict[str, zmq.Socket] = {}
        self.hwm = hwm
        self.closed = False

    def send(self, endpoint: str, channel: bytes, key: int, leased: Leased) -> None:
        """The decode half ``leased`` to the worker at ``endpoint``, its items for ``channel``'s ``key``."""
        if self.closed:
            raise ChannelLost("the leased sender is closed")
        sock = self._socks.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            for opt, v in ((zmq.LINGER, 0), (zmq.SNDHWM, self.hwm)):
                sock.setsockopt(opt, v)
            sock.connect(endpoint)
            self._socks[endpoint] = sock
        bufs: list[pickle.PickleBuffer] = []
        head = pickle.dumps(leased, protocol=5, buffer_callback=bufs.append)
        try:
            sock.send_multipart([LEASED, channel, key.to_bytes(8, "little"), head, *(b.raw() for b in bufs)],
                                copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            raise ChannelLost(f"the decode worker at {endpoint} reads no requests ({self.hwm} queued)") from None

    def close(self) -> None:
        self.closed = True
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
        self._ctx.term()


RETURNED = object()   # in a request's queue: its call returned (its last item is due, if not already there)


def remote_error(name: str, message: str, worker: str = "") -> Exception:
    """The exception a worker's ERROR message says, as the ingress raises it."""
    if name == "PeerFailed":
        return PeerFailed(message, worker)
    if name == "StaleChannel":
        return StaleChannel(message)
    return ERROR_KINDS.get(name, RuntimeError)(message)


async def settle(call: Awaitable, q: asyncio.Queue) -> None:
    """A request's call's outcome into its queue, behind the items already there: RETURNED, or what it
    raised (a dead worker, a bad request)."""
    try:
        await call
    except Exception as e:  # noqa: BLE001 - handed to the request's reader
        q.put_nowait(e)
    else:
        q.put_nowait(RETURNED)


async def request_items(q: asyncio.Queue, timeout: float, grace: float) -> AsyncIterator[StreamItem]:
    """One request's items from its queue, up to its last. Raises what its call raised (``settle``),
    asyncio.TimeoutError when no item comes within ``timeout`` of the one before, ChannelLost when the call
    returned and the last item does not follow within ``grace`` (both left the worker in that order, on
    different paths: the return may overtake the items)."""
    over = False
    while True:
        if not q.empty():
            x = q.get_nowait()
        else:
            try:   # a timer, not wait_for's task per item
                async with asyncio.timeout(grace if over else timeout):
                    x = await q.get()
            except TimeoutError:
                if over:
                    raise ChannelLost(f"the call returned, and its last item did not come in {grace:.0f}s") from None
                raise
        if x is RETURNED:
            over = True
        elif isinstance(x, BaseException):
            raise x
        else:
            yield x
            if x.finished:
                return


__all__ = ["RETURNED", "ChannelClient", "ChannelLost", "ChannelServer", "Handoff", "Leased", "LeasedSender",
           "Reserve", "Route", "StaleChannel", "decode_items", "encode_items", "remote_error", "request_items", "settle"]
