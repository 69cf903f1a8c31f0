"""``KVEventPublisher``: one process's KV events on the field's wire (wire.py), over ZMQ. No Ray.

Two sockets:

* **PUB** (``endpoint.pub``): one message per batch, frames ``[topic, seq, payload]``; ``seq`` is 8 bytes
  big-endian, 0 for the first batch of this publisher and +1 for each next one, so a subscriber sees a gap
  when it missed one (ZMQ PUB drops for a slow subscriber, and a new subscriber misses what came before).
* **ROUTER** replay (``endpoint.replay``, ``replay_port_offset`` above the PUB port): a request
  ``[identity, b"", start_seq]`` (a DEALER's or REQ's 8-byte big-endian start seq) is answered
  ``[identity, b"", seq, payload]`` for every batch still buffered from ``start_seq`` on, then
  ``[identity, b"", -1 (8 bytes, signed), b""]``. The buffer keeps the last ``buffer_batches`` batches: a
  consumer asking for an older seq gets what is left (its first answer's seq says what it missed).

Thread-safety: ``publish`` may be called from any thread. A lock orders seq, send and buffer; the PUB
socket is only ever used under it (ZMQ sockets may change threads across a full barrier), the replay socket
only by the replay thread, which snapshots the buffer under the lock and answers outside it.
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import NamedTuple, Optional, Sequence

import zmq

from storage.kv_events.config import KVEventsConfig
from storage.kv_events.wire import END_OF_REPLAY, EventBatch, KVWireEvent, decode_seq, encode_batch, encode_seq, topic

log = logging.getLogger("strata.kv_events")

_POLL_MS = 100   # how often the replay thread looks at ``close``


class KVEventsEndpoint(NamedTuple):
    """Where a publisher is: its ``topic`` and the ZMQ addresses of its PUB and replay sockets."""

    topic: str
    pub: str
    replay: str


class StreamPosition(NamedTuple):
    """Where a publisher's stream stands: its ``endpoint`` and the seq of the last batch it published (-1:
    none yet). A consumer that has applied everything up to ``seq`` has all that was said before."""

    endpoint: KVEventsEndpoint
    seq: int


class PublisherStats(NamedTuple):
    """Counts since the publisher started: batches published (the next seq), events published, batches
    dropped from the replay buffer (too old), replay requests answered."""

    batches: int
    events: int
    dropped: int
    replays: int


class KVEventPublisher:
    """Publishes event batches for ``model`` on ``cfg``'s ports (see the module doc). ``host`` overrides
    ``cfg.host`` (an actor shell resolves ``auto`` to its node's IP and passes it)."""

    def __init__(self, cfg: KVEventsConfig, model: str, host: Optional[str] = None,
                 data_parallel_rank: Optional[int] = None) -> None:
        if not isinstance(cfg, KVEventsConfig):
            raise ValueError(f"cfg must be a KVEventsConfig, got {type(cfg).__name__}")
        if not model:
            raise ValueError("model: the served model name, not empty")
        self.cfg = cfg
        self.host = host or cfg.host
        if self.host == "auto":
            raise ValueError("host 'auto' is resolved by the caller (this node's IP)")
        self.rank = data_parallel_rank
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER)
        for s in (self._pub, self._replay):
            s.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, cfg.send_hwm)
        try:
            self.port = self._bind()
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self.replay_port = self.port + cfg.replay_port_offset
        self.endpoint = KVEventsEndpoint(topic(self.host, self.port, model), f"tcp://{self.host}:{self.port}",
                                         f"tcp://{self.host}:{self.replay_port}")
        self._topic = self.endpoint.topic.encode()
        self._lock = threading.Lock()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=cfg.buffer_batches)
        self._seq = 0
        self._events = self._dropped = self._replays = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, name="strata-kv-replay", daemon=True)
        self._thread.start()

    def _bind(self) -> int:
        """Bind PUB and replay on the first pair of free ports; the PUB port."""
        off, host = self.cfg.replay_port_offset, self.host
        if self.cfg.port == 0:
            candidates = [None] * 32   # random ports, tried until a pair is free
        else:
            candidates = list(range(self.cfg.port, self.cfg.port + self.cfg.port_range))
        last: Optional[Exception] = None
        for port in candidates:
            try:
                if port is None:
                    port = self._pub.bind_to_random_port(f"tcp://{host}", min_port=20000, max_port=65536 - off)
                else:
                    self._pub.bind(f"tcp://{host}:{port}")
            except zmq.ZMQBaseError as e:   # ZMQBindError (no random port left) is not a ZMQError
                last = e
                continue
            try:
                self._replay.bind(f"tcp://{host}:{port + off}")
                return port
            except zmq.ZMQError as e:
                last = e
                self._pub.unbind(f"tcp://{host}:{port}")
        raise OSError(f"kv_events: no free PUB/replay port pair on {host} "
                      f"({'random' if not self.cfg.port else f'{self.cfg.port}..+{self.cfg.port_range}'}): {last}")

    # ------------------------------------------------------------------ publishing

    def publish(self, events: Sequence[KVWireEvent], ts: float) -> int:
        """Publish ``events`` as one batch stamped ``ts`` (seconds since the epoch); its seq. An empty list
        publishes nothing (-1): seqs count batches of news."""
        if not events:
            return -1
        payload = encode_batch(EventBatch(ts, list(events), self.rank), self.cfg.encoding)
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError("publisher is closed")
            seq = self._seq
            self._seq += 1
            # Never blocks: PUB drops for a subscriber over its high-water mark (replay covers it).
            self._pub.send_multipart((self._topic, encode_seq(seq), payload), copy=False)
            if len(self._buffer) == self._buffer.maxlen:
                self._dropped += 1
            self._buffer.append((seq, payload))
            self._events += len(events)
        return seq

    def position(self) -> StreamPosition:
        """The endpoint and the last seq published."""
        with self._lock:
            return StreamPosition(self.endpoint, self._seq - 1)

    def stats(self) -> PublisherStats:
        with self._lock:
            return PublisherStats(self._seq, self._events, self._dropped, self._replays)

    # ------------------------------------------------------------------ replay

    def _serve_replay(self) -> None:
        sock = self._replay
        while not self._closed.is_set():
            try:
                if not sock.poll(_POLL_MS):
                    continue
                frames = sock.recv_multipart()
            except zmq.ZMQError:
                if self._closed.is_set():
                    return
                raise
            try:
                self._answer(sock, frames)
            except Exception as e:  # noqa: BLE001 - one bad request must not end replay for everyone
                log.warning("kv_events replay request failed: %r", e)

    def _answer(self, sock, frames: list[bytes]) -> None:
        # [identity, b"", start] from a REQ or a DEALER sending the empty delimiter; [identity, start] from
        # a DEALER without it (answered the same way, with the delimiter).
        if len(frames) == 3 and frames[1] == b"":
            ident, start = frames[0], frames[2]
        elif len(frames) == 2:
            ident, start = frames
        else:
            log.warning("kv_events replay: bad request of %d frames", len(frames))
            return
        try:
            first = decode_seq(start)
        except ValueError:
            sock.send_multipart((ident, b"", END_OF_REPLAY, b""))
            return
        with self._lock:
            todo = [(s, p) for s, p in self._buffer if s >= first]
            self._replays += 1
        for s, p in todo:
            sock.send_multipart((ident, b"", encode_seq(s), p), copy=False)
        sock.send_multipart((ident, b"", END_OF_REPLAY, b""))

    # ------------------------------------------------------------------ life

    def close(self) -> None:
        """Stop replaying and close both sockets (idempotent)."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
        self._thread.join(timeout=2 * _POLL_MS / 1000 + 1)
        self._pub.close(linger=0)
        self._replay.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> "KVEventPublisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["KVEventPublisher", "KVEventsEndpoint", "PublisherStats", "StreamPosition"]
