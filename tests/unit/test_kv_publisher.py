"""``KVEventPublisher`` (storage/kv_events/publisher.py) on real ZMQ sockets on 127.0.0.1: a SUB sees
``[topic, seq, payload]`` with contiguous seqs, a replay client (DEALER) gets the buffered batches
from a seq and the -1 terminator, the buffer drops its oldest batches, ports and close behave."""
from __future__ import annotations

import threading
import time

import pytest
import zmq

from storage.kv_events import (END_OF_REPLAY, POSITIONAL, AllBlocksCleared, BlockRemoved, KVEventPublisher,
                               KVEventsConfig, decode_batch, decode_seq, encode_seq)

HOST = "127.0.0.1"
TIMEOUT_MS = 5000


def batch(i: int) -> list:
    return [BlockRemoved([i], "GPU", 0)]


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def subscribe(ctx, pub: KVEventPublisher, prefix: bytes = b""):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, prefix)
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sub.connect(pub.endpoint.pub)
    return sub


def joined(sub, pub: KVEventPublisher) -> int:
    """Publish probes until the SUB receives one (a SUB misses what is sent before its subscription
    reaches the PUB); the seq of the next batch."""
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while time.monotonic() < deadline:
        pub.publish([AllBlocksCleared()], ts=0.0)
        if sub.poll(50):
            while sub.poll(50):
                sub.recv_multipart()
            return pub.stats().batches
    raise TimeoutError("the SUB never joined")


def replay(sock, start: int, delimiter: bool = True) -> list[tuple[int, bytes]]:
    sock.send_multipart(([b""] if delimiter else []) + [encode_seq(start)])
    out = []
    while True:
        frames = sock.recv_multipart()
        assert frames[0] == b""   # the answer always carries the delimiter
        frames = frames[1:]
        seq, payload = frames
        if seq == END_OF_REPLAY:
            assert payload == b""
            return out
        out.append((decode_seq(seq), payload))


def test_pub_frames_and_contiguous_seqs(ctx):
    cfg = KVEventsConfig(host=HOST, encoding=POSITIONAL)
    with KVEventPublisher(cfg, "strata-tiny") as pub:
        ep = pub.endpoint
        assert ep.topic == f"kv@{HOST}:{pub.port}@strata-tiny" and ep.pub == f"tcp://{HOST}:{pub.port}"
        assert ep.replay == f"tcp://{HOST}:{pub.port + 1000}"
        sub = subscribe(ctx, pub, ep.topic.encode())
        first = joined(sub, pub)
        assert pub.publish([], ts=1.0) == -1   # nothing new, no batch
        seqs = [pub.publish(batch(i), ts=float(i)) for i in range(20)]
        assert seqs == list(range(first, first + 20))
        for i in range(20):
            topic, seq, payload = sub.recv_multipart()
            assert topic == ep.topic.encode() and decode_seq(seq) == first + i
            assert decode_batch(payload).events == batch(i)
        st = pub.stats()
        assert st.batches == first + 20 and st.dropped == 0


def test_seq_starts_at_zero_and_publish_is_thread_safe():
    with KVEventPublisher(KVEventsConfig(host=HOST), "m") as pub:
        assert pub.publish(batch(0), ts=0.0) == 0
        got: list[int] = []
        lock = threading.Lock()

        def many():
            mine = [pub.publish(batch(1), ts=0.0) for _ in range(200)]
            with lock:
                got.extend(mine)
        threads = [threading.Thread(target=many) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(got) == list(range(1, 801)) and pub.stats().events == 801


@pytest.mark.parametrize("delimiter", [True, False])
def test_replay_from_a_seq_ends_with_minus_one(ctx, delimiter):
    """A DEALER (with the REQ-style empty delimiter frame, as vLLM's clients send, or without): a REQ
    socket cannot take the several answers of one request."""
    with KVEventPublisher(KVEventsConfig(host=HOST), "m") as pub:
        for i in range(10):
            pub.publish(batch(i), ts=float(i))
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        sock.connect(pub.endpoint.replay)
        got = replay(sock, 4, delimiter)
        assert [s for s, _ in got] == list(range(4, 10))
        assert [decode_batch(p).events for _, p in got] == [batch(i) for i in range(4, 10)]
        # Further requests on the same socket; one past the end gets only the end.
        assert replay(sock, 10, delimiter) == []
        assert [s for s, _ in replay(sock, 0, delimiter)] == list(range(10))
        assert pub.stats().replays == 3


def test_the_buffer_drops_its_oldest_batches(ctx):
    with KVEventPublisher(KVEventsConfig(host=HOST, buffer_batches=4), "m") as pub:
        for i in range(10):
            pub.publish(batch(i), ts=0.0)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        sock.connect(pub.endpoint.replay)
        got = replay(sock, 0)
        assert [s for s, _ in got] == [6, 7, 8, 9]   # the first answer's seq shows the gap
        assert pub.stats().dropped == 6


def test_a_bad_request_is_answered_and_replay_goes_on(ctx):
    with KVEventPublisher(KVEventsConfig(host=HOST), "m") as pub:
        pub.publish(batch(0), ts=0.0)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        sock.connect(pub.endpoint.replay)
        sock.send_multipart([b"", b"abc"])
        assert sock.recv_multipart() == [b"", END_OF_REPLAY, b""]
        assert [s for s, _ in replay(sock, 0)] == [0]


def test_fixed_ports_take_the_next_free_pair_and_close_frees_them():
    probe = KVEventPublisher(KVEventsConfig(host=HOST), "m")
    base = probe.port
    probe.close()
    probe.close()   # idempotent
    with pytest.raises(RuntimeError):
        probe.publish(batch(0), ts=0.0)
    cfg = KVEventsConfig(host=HOST, port=base, port_range=4)
    a = KVEventPublisher(cfg, "m")
    b = KVEventPublisher(cfg, "m")
    try:
        assert a.port == base and b.port == base + 1 and b.replay_port == base + 1001
    finally:
        a.close()
        b.close()
    with KVEventPublisher(cfg, "m") as again:   # closed ports are free again
        assert again.port == base
    taken = KVEventPublisher(KVEventsConfig(host=HOST, port=base, port_range=1), "m")
    try:
        with pytest.raises(OSError):
            KVEventPublisher(KVEventsConfig(host=HOST, port=base, port_range=1), "m")
    finally:
        taken.close()


def test_bad_arguments():
    with pytest.raises(ValueError):
        KVEventPublisher(KVEventsConfig(host="auto"), "m")
    with pytest.raises(ValueError):
        KVEventPublisher(KVEventsConfig(host=HOST), "")
    with pytest.raises(ValueError):
        KVEventPublisher({"host": HOST}, "m")


def test_tree_and_l3_streams(ctx):
    """A tree's batch then a flush (AllBlocksCleared closing the batch); the storage actor's L3 stream:
    forwarded L3 writes, evictions by object name, a clear."""
    from storage.kv_events import DISK, BlockStored, TreeEventStream, WireMapping, block_hash, worker_media
    from storage.kv_events.l3_stream import L3EventStream
    from storage.l3.index import L3NameIndex
    from storage.radix import FULL, L1, L3, KVEvent
    keys = (bytes(range(16)), bytes(range(1, 17)))
    toks = list(range(8))
    with KVEventPublisher(KVEventsConfig(host=HOST), "m") as pub:
        tree = TreeEventStream(pub, WireMapping.of(4, 0, worker_media()))
        assert tree.endpoint == pub.endpoint
        ev = [KVEvent("stored", L1, FULL, keys, toks), KVEvent("stored", L3, FULL, keys, toks)]
        assert tree.publish(ev, 1.0) == 0
        assert tree.publish([KVEvent("removed", L1, FULL, keys)], 2.0, cleared=True) == 1
        assert tree.publish([KVEvent("stored", L3, FULL, keys, toks)], 3.0) == -1   # no tier of its own
        l3 = L3EventStream(TreeEventStream(KVEventPublisher(KVEventsConfig(host=HOST), "m"),
                                           WireMapping.of(4, 0, {L3: DISK})), L3NameIndex("model-x"))
        try:
            assert l3.stored(ev, 1.0) == 0                    # only the L3 write of the two
            assert l3.evicted([l3.names.name(FULL, keys[1]), "unknown"], 2.0) == 1
            assert l3.evicted(["unknown"], 3.0) == -1
            assert l3.cleared(4.0) == 2 and len(l3.names) == 0
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
            sock.connect(l3.stream.endpoint.replay)
            got = [decode_batch(p).events for _, p in replay(sock, 0)]
            h = [block_hash(k) for k in keys]
            assert got == [[BlockStored(h, None, toks, 4, None, DISK, None, None, 0, "full_attention", None)],
                           [BlockRemoved([h[1]], DISK, 0)], [AllBlocksCleared()]]
        finally:
            l3.close()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
        sock.connect(pub.endpoint.replay)
        got = [decode_batch(p).events for _, p in replay(sock, 0)]
        assert [[type(e).__name__ for e in b] for b in got] == [["BlockStored"], ["BlockRemoved", "AllBlocksCleared"]]
        assert got[0][0].medium == "GPU" and got[0][0].token_ids == toks
