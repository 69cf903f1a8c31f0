"""``KVEventSubscriber``: the consuming end of the KV-event wire (publisher.py) for many publishers at once,
with gap repair by replay. No Ray: strata's router actor (actors/router.py) holds one.

One SUB socket is connected to every followed publisher's PUB endpoint and subscribed to its topic; each
publisher also gets a DEALER on its replay endpoint. Per publisher the subscriber keeps ``next``, the seq it
must apply next:

* a batch with ``seq == next`` is delivered and ``next`` moves on;
* ``seq < next`` was delivered already (by a replay, or a repeated SUB message): skipped;
* ``seq > next`` is a gap (ZMQ dropped for a slow subscriber, or the subscription was not yet in place
  when the batch went out): the missing batches are asked of the replay socket from ``next``. When the
  replay's first batch comes later than ``next`` (the publisher's buffer no longer holds them), the history
  is lost: a ``Lost`` update says so, and the consumer must forget what it knew of that publisher and ask
  it for a snapshot (a batch beginning with AllBlocksCleared, then BlockStored for all it holds).

``follow`` starts a publisher at seq 0 (history is asked of the replay at once, not waited for); an
endpoint that changes, or ``restart``, is a new incarnation (its seq starts from 0 again).
``catch_up(name, seq)`` returns only once every batch up to ``seq`` is delivered (or lost), which is what
makes a report to the router a barrier: the worker says the last seq it published, and after the report
the router's index holds everything before it.

Not thread-safe: one thread uses it (the router actor's).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import zmq

from storage.kv_events.publisher import KVEventsEndpoint
from storage.kv_events.wire import EventBatch, decode_batch, decode_seq, encode_seq

log = logging.getLogger("strata.kv_events")


class Delivered(NamedTuple):
    """Batch ``seq`` of publisher ``name``, in order."""

    name: str
    seq: int
    batch: EventBatch


class Lost(NamedTuple):
    """Publisher ``name``'s batches ``first`` .. ``upto - 1`` can no longer be had (replay buffer overrun,
    an undecodable payload, or a replay socket that does not answer): what was known of it is unsure."""

    name: str
    first: int
    upto: int


Update = Union[Delivered, Lost]


@dataclass
class _Followed:
    name: str
    endpoint: KVEventsEndpoint
    topic: bytes
    dealer: zmq.Socket
    next: int = 0
    quiet_until: float = 0.0   # its replay did not answer: not asked again before this (monotonic)


class SubscriberStats(NamedTuple):
    """Since start: batches delivered, of which by replay, batches skipped as already delivered, replays
    asked, gaps lost (``Lost`` updates)."""

    delivered: int
    replayed: int
    duplicates: int
    replays: int
    lost: int


class KVEventSubscriber:
    """``replay_timeout``: seconds a replay may take before its publisher is taken as gone (its gap is then
    ``Lost``, and it is not asked again for ``backoff_s``: one unreachable publisher must not hold up every
    call). ``wait_s``: in ``catch_up``, how long to wait on the SUB socket for a batch already published
    before replaying it (a batch sent just before the report usually arrives within it)."""

    def __init__(self, replay_timeout: float = 0.5, wait_s: float = 0.02, backoff_s: float = 5.0) -> None:
        self.replay_timeout, self.wait_s, self.backoff_s = replay_timeout, wait_s, backoff_s
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 0)   # never drop here: the publisher's HWM and replay bound it
        self._by_name: dict[str, _Followed] = {}
        self._by_topic: dict[bytes, _Followed] = {}
        self._delivered = self._replayed = self._duplicates = self._replays = self._lost = 0

    # ------------------------------------------------------------------ who is followed

    def follow(self, name: str, endpoint: KVEventsEndpoint) -> bool:
        """Follow ``name`` at ``endpoint``; True when this is new (not followed yet, or at another endpoint:
        a new incarnation, whose seq starts from 0), False when it was already followed there."""
        old = self._by_name.get(name)
        if old is not None and old.endpoint == endpoint:
            return False
        if old is not None:
            self.unfollow(name)
        topic = endpoint.topic.encode()
        other = self._by_topic.get(topic)
        if other is not None:   # another name's old incarnation published here: it is gone
            self.unfollow(other.name)
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint.replay)
        if not any(f.endpoint.pub == endpoint.pub for f in self._by_name.values()):
            self._sub.connect(endpoint.pub)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        f = _Followed(name, endpoint, topic, dealer)
        self._by_name[name] = self._by_topic[topic] = f
        return True

    def restart(self, name: str) -> None:
        """``name`` restarted at the same endpoint: its seq starts from 0 again."""
        f = self._by_name.get(name)
        if f is not None:
            f.next = 0

    def skip(self, name: str, upto: int) -> list[Update]:
        """Give up ``name``'s batches before ``upto`` (a consumer that would rather ask for a snapshot than
        replay a long history): a ``Lost`` for them, when there are any."""
        f = self._by_name.get(name)
        if f is None or upto <= f.next:
            return []
        return [self._lose(f, upto)]

    def unfollow(self, name: str) -> None:
        f = self._by_name.pop(name, None)
        if f is None:
            return
        self._by_topic.pop(f.topic, None)
        try:
            self._sub.setsockopt(zmq.UNSUBSCRIBE, f.topic)
            if not any(g.endpoint.pub == f.endpoint.pub for g in self._by_name.values()):
                self._sub.disconnect(f.endpoint.pub)
        except zmq.ZMQError:
            pass
        f.dealer.close(linger=0)

    def followed(self) -> dict[str, KVEventsEndpoint]:
        return {n: f.endpoint for n, f in self._by_name.items()}

    def next_seq(self, name: str) -> Optional[int]:
        f = self._by_name.get(name)
        return f.next if f is not None else None

    # ------------------------------------------------------------------ reading

    def poll(self, timeout_s: float = 0.0) -> list[Update]:
        """Every batch waiting on the SUB socket (waiting up to ``timeout_s`` for the first), gaps repaired."""
        out: list[Update] = []
        sub = self._sub
        if timeout_s > 0 and not sub.poll(int(timeout_s * 1000)):
            return out
        while True:
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) != 3:
                log.warning("kv_events: a SUB message of %d frames skipped", len(frames))
                continue
            f = self._by_topic.get(frames[0])
            if f is None:
                continue   # unfollowed meanwhile
            try:
                seq = decode_seq(frames[1])
            except ValueError:
                log.warning("kv_events: %s sent a bad seq frame", f.name)
                continue
            if seq < f.next:
                self._duplicates += 1
                continue
            if seq > f.next:
                if time.monotonic() >= f.quiet_until:
                    out += self._replay(f)
                if seq < f.next:
                    continue
                if seq > f.next:   # the replay did not reach it (its buffer is smaller than one batch?)
                    out.append(self._lose(f, seq))
            out.append(self._deliver(f, seq, frames[2], replayed=False))

    def catch_up(self, name: str, seq: int) -> list[Update]:
        """Updates until ``name``'s batch ``seq`` is delivered (or lost); ``seq`` < 0: whatever is waiting."""
        out = self.poll()
        f = self._by_name.get(name)
        if f is None or f.next > seq:
            return out
        deadline = time.monotonic() + self.wait_s
        while f.next <= seq and self._by_name.get(name) is f:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            out += self.poll(left)
        if self._by_name.get(name) is f and f.next <= seq and time.monotonic() >= f.quiet_until:
            out += self._replay(f)
            if f.next <= seq:   # the publisher says it published ``seq``, its replay does not have it
                out.append(self._lose(f, seq + 1))
        return out

    def _deliver(self, f: _Followed, seq: int, payload: bytes, replayed: bool) -> Update:
        f.next = seq + 1
        try:
            batch = decode_batch(payload)
        except ValueError as e:
            log.warning("kv_events: %s batch %d undecodable: %s", f.name, seq, e)
            self._lost += 1
            return Lost(f.name, seq, seq + 1)
        self._delivered += 1
        self._replayed += replayed
        return Delivered(f.name, seq, batch)

    def _lose(self, f: _Followed, upto: int) -> Lost:
        lost = Lost(f.name, f.next, upto)
        f.next = upto
        self._lost += 1
        return lost

    def _replay(self, f: _Followed) -> list[Update]:
        """Ask ``f``'s replay socket for everything from ``f.next``; the updates, in order."""
        self._replays += 1
        out: list[Update] = []
        f.dealer.send_multipart((b"", encode_seq(f.next)))
        deadline = time.monotonic() + self.replay_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not f.dealer.poll(int(left * 1000) + 1):
                log.warning("kv_events: %s's replay (%s) did not answer in %.1f s", f.name, f.endpoint.replay,
                            self.replay_timeout)
                self._renew_dealer(f)   # a late answer must not be read as the next one's
                f.quiet_until = time.monotonic() + self.backoff_s
                return out
            frames = f.dealer.recv_multipart()
            if len(frames) != 3 or frames[0] != b"":
                continue
            try:
                seq = decode_seq(frames[1])
            except ValueError:
                continue
            if seq < 0:
                f.quiet_until = 0.0
                return out
            if seq < f.next:
                continue
            if seq > f.next:
                out.append(self._lose(f, seq))
            out.append(self._deliver(f, seq, frames[2], replayed=True))

    def _renew_dealer(self, f: _Followed) -> None:
        f.dealer.close(linger=0)
        f.dealer = self._ctx.socket(zmq.DEALER)
        f.dealer.setsockopt(zmq.LINGER, 0)
        f.dealer.connect(f.endpoint.replay)

    def stats(self) -> SubscriberStats:
        return SubscriberStats(self._delivered, self._replayed, self._duplicates, self._replays, self._lost)

    def close(self) -> None:
        for name in list(self._by_name):
            self.unfollow(name)
        self._sub.close(linger=0)
        self._ctx.term()


__all__ = ["Delivered", "Lost", "Update", "KVEventSubscriber", "SubscriberStats"]
