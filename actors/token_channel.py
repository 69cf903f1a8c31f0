"""The token channel: a worker's stream items to the ingress replicas, one ZMQ message per engine step and
ingress, beside Ray (no Ray here).

    engine thread --(one step's items)--> ChannelServer (ROUTER, bound on the worker's node)
        --(one message per ingress per step)--> ChannelClient (DEALER, one per worker in each ingress
        replica) --(demultiplexed)--> one asyncio queue per request

Ray still carries the request itself (one call per request, which returns when the request is over) and
with it what Ray does well: a worker that dies fails that call, and cancelling it aborts the request. The
tokens do not ride on it: a Ray streamed object per token costs ~1 ms of CPU in the worker and more in
the ingress (pickled, stored, one RPC each), a step's items for every request of one ingress cost one
message here.

Handshake: a client connects and says HELLO with its routing id; the server records the id and answers
ACK. Only then does the ingress send requests naming that id (``route`` refuses an id it never heard
from, ``StaleChannel``): a ROUTER drops what it sends to a peer it does not know, so an item can never go
to a connection that is not set up yet, and a worker that restarted (a new process, a new server) says
so on the first request instead of sending its items nowhere.

Wire (frames after the ROUTER's routing id): ``[HELLO]`` / ``[ACK]``; ``[ITEMS, payload]``, payload a
msgpack array of ``[key, *StreamItem fields]`` in the dataclass's order (TokenLogprob as arrays), or
``[PICKLED, payload]`` for a batch msgpack cannot encode (a value of an unexpected type).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import select
import threading
from typing import AsyncIterator, Awaitable, Iterable, NamedTuple

import msgspec
import zmq
import zmq.asyncio

from engine.async_engine import StreamItem
from engine.sampling import TokenLogprob

log = logging.getLogger("strata.token_channel")

HELLO, ACK, ITEMS, PICKLED = b"H", b"A", b"I", b"P"
_HELLO_POLL_S = 0.1    # the server's hello thread: at most this late when a send consumed the FD's edge


class StaleChannel(Exception):
    """A request named a channel this worker never heard from: the worker restarted (its server is new)
    or the client's connection is gone. The ingress reconnects and submits again."""


class ChannelLost(Exception):
    """A request's call said it is over but its last item never came on the channel."""


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


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[_Wire])


def encode_items(items: Iterable[tuple[int, StreamItem]]) -> tuple[bytes, bytes]:
    """(kind, payload) of one message of ``(key, item)`` pairs: msgpack, or pickle where msgpack cannot
    (a field of a type the engine does not normally produce)."""
    items = list(items)
    rows = [(k, i.rid, i.token_ids, i.finished, i.finish_reason, i.prompt_tokens, i.cached_tokens,
             i.cached_tokens_by_tier, i.error, i.logprobs, i.prompt_logprobs, i.matched_stop) for k, i in items]
    try:
        return ITEMS, _encoder.encode(rows)
    except (TypeError, msgspec.EncodeError):
        return PICKLED, pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)


def decode_items(kind: bytes, payload: bytes) -> list[tuple[int, StreamItem]]:
    if kind == PICKLED:
        return pickle.loads(payload)
    return [(w.key, StreamItem(w.rid, w.token_ids, w.finished, w.finish_reason, w.prompt_tokens, w.cached_tokens,
                               w.cached_tokens_by_tier, w.error, w.logprobs, w.prompt_logprobs, w.matched_stop))
            for w in _decoder.decode(payload)]


class ChannelServer:
    """A worker's end: a ROUTER bound on ``host`` (a free port); ``endpoint`` says where.

    ``send_step`` is called by the engine thread once per step with that step's routed items and sends one
    message per client at once (the ROUTER never blocks: no high-water mark; a client that is gone is
    dropped by ZMQ). A small thread answers the clients' hellos. The socket is shared by the two threads
    under a lock (ZMQ sockets may change threads across a full barrier), as the KV-event publisher does."""

    def __init__(self, host: str) -> None:
        self._ctx = zmq.Context(1)
        self._sock = self._ctx.socket(zmq.ROUTER)
        for opt, v in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.ROUTER_HANDOVER, 1)):
            self._sock.setsockopt(opt, v)
        try:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self.endpoint = f"tcp://{host}:{port}"
        self._lock = threading.Lock()
        self._peers: set[bytes] = set()
        self._closed = threading.Event()
        self.sent_messages = 0   # messages of items sent (tests, profiling)
        self._thread = threading.Thread(target=self._serve_hellos, name="strata-token-channel", daemon=True)
        self._thread.start()

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
        self._ctx.term()


class ChannelClient:
    """An ingress replica's end of one worker's channel: a DEALER whose reader task (on the event loop
    that opened it) puts each item into its request's queue. Items of a key nobody waits for (a request
    already closed) are dropped."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, identity: bytes) -> None:
        self.endpoint, self.identity = endpoint, identity
        self._sock = ctx.socket(zmq.DEALER)
        for opt, v in ((zmq.LINGER, 0), (zmq.RCVHWM, 0), (zmq.SNDHWM, 0), (zmq.ROUTING_ID, identity)):
            self._sock.setsockopt(opt, v)
        self._sock.connect(endpoint)
        self._queues: dict[int, asyncio.Queue] = {}
        self._keys = itertools.count()
        self.loop = asyncio.get_running_loop()   # the reader's: a client serves requests on this loop only
        self._acked = self.loop.create_future()
        self._reader = asyncio.ensure_future(self._read())
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

    async def _read(self) -> None:
        try:
            while True:
                frames = await self._sock.recv_multipart(copy=True)
                kind = frames[0]
                if kind == ACK:
                    if not self._acked.done():
                        self._acked.set_result(None)
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
        if self.closed:
            return
        self.closed = True
        try:
            self._reader.cancel()
        except RuntimeError:   # its loop is closed already: so is the reader
            pass
        self._sock.close(linger=0)


RETURNED = object()   # in a request's queue: its call returned (its last item is due, if not already there)


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


__all__ = ["RETURNED", "ChannelClient", "ChannelLost", "ChannelServer", "Route", "StaleChannel", "decode_items",
           "encode_items", "request_items", "settle"]
