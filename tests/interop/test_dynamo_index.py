"""Dynamo's KV indexer reading hand-built vLLM-format KV-event batches from a real ZMQ socket on 127.0.0.1.

Proves the harness (tests/interop/dynamo_index.py) and pins what the installed Dynamo does with the wire,
in both event encodings: parent chains, removal, clearing, tiers by medium, and what it drops (unknown
parent, another block size, the sliding-window group). The batches are built here from the wire's
definition, not by strata's encoder, so a failure points at Dynamo's reading or at this understanding of
it, never at strata's publisher."""
from __future__ import annotations

import random
import struct
import threading
import time

import pytest

from tests.interop.dynamo_index import AVAILABLE, SKIP_REASON, DynamoIndex, TierOverlap, WorkerStream

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")

pytestmark = pytest.mark.skipif(not AVAILABLE, reason=SKIP_REASON)

BS = 16                     # strata-tiny's page size
END_OF_REPLAY = struct.pack(">q", -1)


# ---- the wire, built by hand ----------------------------------------------------------------------------

def stored(hashes, parent, tokens, medium="GPU", group=0, kind="full_attention", window=None, block_size=BS):
    """A BlockStored event as a tagged map (fields in vLLM's declaration order)."""
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": list(tokens), "block_size": block_size, "lora_id": None, "medium": medium,
            "lora_name": None, "extra_keys": None, "group_idx": group, "kv_cache_spec_kind": kind,
            "kv_cache_spec_sliding_window": window}


def removed(hashes, medium="GPU", group=0, kind="full_attention", window=None):
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium, "group_idx": group,
            "kv_cache_spec_kind": kind, "kv_cache_spec_sliding_window": window}


CLEARED = {"type": "AllBlocksCleared"}


def positional(event: dict) -> list:
    """The same event in the array encoding: its tag, then its fields in declaration order."""
    return [event["type"], *(v for k, v in event.items() if k != "type")]


class WirePublisher:
    """One worker's end of the wire, driven by hand: frames [topic, seq (8-byte BE), msgpack
    [ts, events, dp_rank]] on an XPUB (a PUB that lets the test see Dynamo subscribe), and a ROUTER
    replay socket answering an 8-byte start seq with (seq, payload) frames ending in (-1, b"")."""

    def __init__(self, ctx, encoding: str, topic: bytes = b"kv@127.0.0.1@strata-tiny"):
        self.encoding, self.topic = encoding, topic
        self.history: list[tuple[int, bytes]] = []
        self.replay_requests: list[int] = []
        self._ctx = ctx
        self._pub = self._xpub()
        port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._router = ctx.socket(zmq.ROUTER)
        rport = self._router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self._stop = threading.Event()
        # The ROUTER lives on its own thread (zmq sockets are not shared between threads).
        self._replayer = threading.Thread(target=self._serve_replay, daemon=True)
        self._replayer.start()

    def _xpub(self):
        sock = self._ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)     # every subscription reaches wait_subscribed, not the first
        return sock

    def restart(self) -> None:
        """A new incarnation on the same endpoint: its seq starts again from 0, its history is its own."""
        self._pub.unbind(self.endpoint)
        self._pub.close(linger=0)
        self.history.clear()
        self._pub = self._xpub()
        # zmq releases the port on its I/O thread, after close() returns: bind again until it is free.
        deadline = time.monotonic() + 10.0
        while True:
            try:
                self._pub.bind(self.endpoint)
                return
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(50):
                continue
            frames = self._router.recv_multipart()
            ident, start = frames[0], struct.unpack(">Q", frames[-1])[0]
            self.replay_requests.append(start)
            for seq, payload in list(self.history):
                if seq >= start:
                    self._router.send_multipart([ident, b"", struct.pack(">Q", seq), payload])
            self._router.send_multipart([ident, b"", END_OF_REPLAY, b""])
        self._router.close(linger=0)

    def wait_subscribed(self, timeout_s: float = 10.0) -> None:
        """Block until a subscriber's subscription has reached this socket (no slow-joiner loss after)."""
        deadline = time.monotonic() + timeout_s
        while self._pub.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            if self._pub.recv()[:1] == b"\x01":     # a subscription (b"\x00": a subscriber leaving)
                return
        raise TimeoutError(f"nobody subscribed to {self.endpoint}")

    def publish(self, events: list[dict], drop: bool = False) -> int:
        """Send one batch (``drop``: keep it for replay only, as if the network lost it); -> its seq."""
        seq = len(self.history)
        wire = [positional(e) for e in events] if self.encoding == "positional" else events
        payload = msgpack.packb([time.time(), wire, 0])
        self.history.append((seq, payload))
        if not drop:
            self._pub.send_multipart([self.topic, struct.pack(">Q", seq), payload])
        return seq

    def stream(self, worker_id: int) -> WorkerStream:
        return WorkerStream(worker_id, self.endpoint, self.replay_endpoint)

    def close(self) -> None:
        self._stop.set()
        self._replayer.join(timeout=5)
        self._pub.close(linger=0)


# ---- fixtures -----------------------------------------------------------------------------------------

@pytest.fixture(params=["map", "positional"])
def encoding(request):
    return request.param


@pytest.fixture
def wire(encoding):
    """-> make(n) giving n publishers and a DynamoIndex subscribed to them (worker ids 1..n)."""
    ctx = zmq.Context()
    made: list = []

    def make(n: int, publish_first=None):
        pubs = [WirePublisher(ctx, encoding) for _ in range(n)]
        made.extend(pubs)
        if publish_first is not None:   # batches sent before anyone listens: only replay can recover them
            publish_first(pubs)
        index = DynamoIndex([p.stream(i + 1) for i, p in enumerate(pubs)], block_size=BS)
        made.append(index)
        for p in pubs:
            p.wait_subscribed()
        return pubs, index

    yield make
    for obj in reversed(made):
        obj.close()
    ctx.term()


def prompt(seed: int, n_blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n_blocks * BS)]


def blocks(tokens, i, j):
    """Token ids of blocks [i, j) of ``tokens``."""
    return tokens[i * BS:j * BS]


# Block ids as a publisher would make them: arbitrary 64-bit values, some past 2**63 (sent unsigned).
H = [0x9E3779B97F4A7C15 + k * 0x100000001B3 for k in range(8)]


def expect(index, tokens, want: dict, timeout_s: float = 10.0):
    got = index.wait_for(tokens, want, timeout_s=timeout_s)
    assert got == want


# ---- the tests ----------------------------------------------------------------------------------------

def test_parent_chains_across_batches_per_worker(wire):
    (w1, w2), index = wire(2)
    t = prompt(1, 4)
    w1.publish([stored(H[0:2], None, blocks(t, 0, 2))])
    w1.publish([stored(H[2:3], H[1], blocks(t, 2, 3))])       # child of the previous batch's last block
    w2.publish([stored(H[0:1], None, blocks(t, 0, 1))])
    expect(index, t, {1: 3, 2: 1})
    # Dynamo matches by its own hashes of the token ids, not by the publisher's ids: a prompt that shares
    # only the first block with what worker 1 stored overlaps it by one block.
    other = blocks(t, 0, 1) + prompt(2, 3)
    assert index.device_overlaps(other) == {1: 1, 2: 1}


def test_removed_cuts_the_prefix_and_cleared_empties_the_worker(wire):
    (w1,), index = wire(1)
    t = prompt(3, 4)
    w1.publish([stored(H[0:4], None, blocks(t, 0, 4))])
    expect(index, t, {1: 4})
    w1.publish([removed([H[2]])])                             # an interior block: the match stops before it
    expect(index, t, {1: 2})
    w1.publish([CLEARED])
    expect(index, t, {1: 0})
    w1.publish([stored(H[0:1], None, blocks(t, 0, 1))])      # and it indexes again after a clear
    expect(index, t, {1: 1})


def test_tiers_by_medium_cumulative_down_the_tiers(wire):
    (w1, w2, w3), index = wire(3)
    t = prompt(4, 4)
    # Worker 1: L1 (GPU) holds 2 blocks, L2 (CPU_PINNED) the same 2 and one more: host extends device.
    w1.publish([stored(H[0:2], None, blocks(t, 0, 2)),
                stored(H[0:3], None, blocks(t, 0, 3), medium="CPU_PINNED")])
    # Worker 2: the host tier only; "CPU" is host to Dynamo, and DISK the tier below it.
    w2.publish([stored(H[0:1], None, blocks(t, 0, 1), medium="CPU"),
                stored(H[0:2], None, blocks(t, 0, 2), medium="DISK")])
    # Worker 3: a host block whose parent is on device only (a leaf written back on eviction while its
    # parent stays in L1): a lower tier may continue a prefix held above it.
    w3.publish([stored(H[0:2], None, blocks(t, 0, 2)),
                stored(H[2:3], H[1], blocks(t, 2, 3), medium="CPU_PINNED")])
    expect(index, t, {1: TierOverlap(2, 3, 3), 2: TierOverlap(0, 1, 2), 3: TierOverlap(2, 3, 3)})
    # Removal is per tier: the device copy goes, the host copy stays.
    w1.publish([removed(H[0:2])])
    expect(index, t, {1: TierOverlap(0, 3, 3), 2: TierOverlap(0, 1, 2)})
    w1.publish([removed([H[2]], medium="CPU_PINNED")])
    expect(index, t, {1: TierOverlap(0, 2, 2), 2: TierOverlap(0, 1, 2)})
    # AllBlocksCleared clears every tier of that worker only.
    w1.publish([CLEARED])
    expect(index, t, {1: TierOverlap(0, 0, 0), 2: TierOverlap(0, 1, 2)})


def test_eviction_to_the_host_tier_leaf_first(wire):
    """A prefix that moves from device to host the way a write-back L1 evicts (leaf first, each leaf
    written to the host tier before its device copy goes) stays matched, counted on the tier it is on."""
    (w1, w2, w3), index = wire(3)
    t = prompt(10, 3)
    for w in (w1, w2, w3):
        w.publish([stored(H[0:3], None, blocks(t, 0, 3))])
    expect(index, t, {1: TierOverlap(3, 3, 3), 2: TierOverlap(3, 3, 3), 3: TierOverlap(3, 3, 3)})
    # Worker 1: the whole chain, leaf by leaf. Worker 2: the leaf, then its parent, the root stays.
    for k in (2, 1, 0):
        w1.publish([stored(H[k:k + 1], H[k - 1] if k else None, blocks(t, k, k + 1), medium="CPU_PINNED"),
                    removed(H[k:k + 1])])
    for k in (2, 1):
        w2.publish([stored(H[k:k + 1], H[k - 1], blocks(t, k, k + 1), medium="CPU_PINNED"),
                    removed(H[k:k + 1])])
    # Worker 3: the leaf is written back, then its parent leaves the device with no host copy: the
    # match stops at the parent, on every tier (the leaf is unreachable, as in strata's own walk).
    w3.publish([stored(H[2:3], H[1], blocks(t, 2, 3), medium="CPU_PINNED"), removed(H[2:3])])
    w3.publish([removed(H[1:2])])
    expect(index, t, {1: TierOverlap(0, 3, 3), 2: TierOverlap(1, 3, 3), 3: TierOverlap(1, 1, 1)})


def test_what_dynamo_drops(wire):
    (w1, w2, w3, w4), index = wire(4)
    t = prompt(5, 4)
    # A parent unknown to Dynamo: the whole store is dropped (the chain's first 2 blocks stay).
    w1.publish([stored(H[0:2], None, blocks(t, 0, 2)), stored(H[3:4], H[2], blocks(t, 3, 4))])
    w1.publish([stored(H[2:3], H[1], blocks(t, 2, 3))])       # the missing link comes later: block 4 was lost
    # The parent is known on a lower tier only: the device store is dropped (the other way round is kept,
    # see the tiers test).
    w2.publish([stored(H[0:2], None, blocks(t, 0, 2), medium="CPU_PINNED"),
                stored(H[2:3], H[1], blocks(t, 2, 3))])
    # Another block size than the indexer's: dropped whole.
    w3.publish([stored(H[0:1], None, t[:2 * BS], block_size=2 * BS)])
    # The sliding-window group: ignored, stored and removed alike (a tombstoned window is invisible).
    w4.publish([stored(H[0:2], None, blocks(t, 0, 2)),
                stored(H[4:6], None, blocks(t, 0, 2), group=1, kind="sliding_window", window=128)])
    w4.publish([removed(H[0:1], group=1, kind="sliding_window", window=128)])
    expect(index, t, {1: TierOverlap(3, 3, 3), 2: TierOverlap(0, 2, 2), 3: TierOverlap(0, 0, 0),
                      4: TierOverlap(2, 2, 2)})


def test_replay_recovers_what_was_published_before_and_lost_since(wire):
    t = prompt(6, 4)
    # Seq 0 goes out before Dynamo subscribes: lost on the PUB side.
    (w1,), index = wire(1, publish_first=lambda pubs: pubs[0].publish([stored(H[0:1], None, blocks(t, 0, 1))]))
    w1.publish([stored(H[1:2], H[0], blocks(t, 1, 2))])      # seq 1: Dynamo sees it starts past 0, replays
    expect(index, t, {1: 2})
    w1.publish([stored(H[2:3], H[1], blocks(t, 2, 3))], drop=True)   # seq 2 lost in flight
    w1.publish([stored(H[3:4], H[2], blocks(t, 3, 4))])      # seq 3: gap, replay from 2
    expect(index, t, {1: 4})
    assert w1.replay_requests == [0, 2]


def test_a_restarted_publisher_is_ignored_until_its_worker_is_registered_again(wire):
    (w1,), index = wire(1)
    t, u, v = prompt(7, 2), prompt(8, 2), prompt(9, 2)
    w1.publish([stored(H[0:1], None, blocks(t, 0, 1))])
    w1.publish([stored(H[1:2], H[0], blocks(t, 1, 2))])
    expect(index, t, {1: 2})
    w1.restart()
    w1.wait_subscribed()                                      # Dynamo's listener reconnects by itself
    w1.publish([CLEARED, stored(H[4:5], None, blocks(u, 0, 1))])   # seq 0 and 1 again: at or below the
    w1.publish([stored(H[5:6], H[4], blocks(u, 1, 2))])            # last seq Dynamo saw, dropped unread
    w1.publish([stored(H[6:7], None, blocks(v, 0, 1))])            # seq 2 is past it: read
    expect(index, v, {1: 1})
    # Seq 0 and 1 went before seq 2 on the same listener: the clear and u's blocks were dropped.
    assert index.overlaps(t)[1] == TierOverlap(2, 2, 2)
    assert index.overlaps(u)[1] == TierOverlap(0, 0, 0)
    # Registered again, the worker starts empty and its new incarnation replays from seq 0.
    index.remove_worker(1)
    index.add_worker(w1.stream(1))
    w1.wait_subscribed()
    w1.publish([stored(H[7:8], H[6], blocks(v, 1, 2))])
    expect(index, u, {1: 2})
    assert index.overlaps(t)[1] == TierOverlap(0, 0, 0)
    assert index.overlaps(v)[1] == TierOverlap(2, 2, 2)
