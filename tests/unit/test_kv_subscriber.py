"""The consuming end of the KV-event wire (storage/kv_events/subscriber.py) against real publishers on
127.0.0.1, and the router's index fed by it (actors/prefix_router.py): in order, gaps replayed, duplicates
skipped, a lost history said and repaired by a snapshot, so that the index equals the tree's state."""
from __future__ import annotations

import random
import time

from actors.prefix_router import Router
from actors.routing import L3_WORKER, RouterConfig
from engine import Engine, SamplingParams
from engine.worker_load import WorkerLoad
from storage.config import HiCacheConfig
from storage.geometry import KVGeometry
from storage.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, Delivered, KVEventPublisher, KVEventsConfig,
                               KVEventSubscriber, Lost, TreeEventStream, WireMapping, block_hash, worker_media)
from storage.kv_events.wire import GPU

HOST = "127.0.0.1"


def pub(buffer: int = 100) -> KVEventPublisher:
    return KVEventPublisher(KVEventsConfig(host=HOST, buffer_batches=buffer), "m")


def stored(i: int) -> list:
    return [BlockStored([i], None, [i] * 4, 4, medium=GPU, group_idx=0)]


def delivered(updates) -> list[int]:
    return [u.seq for u in updates if isinstance(u, Delivered)]


def test_in_order_with_the_history_before_following_replayed():
    with pub() as p:
        for i in range(5):   # before anyone follows: only the replay has them
            p.publish(stored(i), 0.0)
        sub = KVEventSubscriber()
        try:
            assert sub.follow("w0", p.endpoint) and not sub.follow("w0", p.endpoint)
            ups = sub.catch_up("w0", p.position().seq)
            assert delivered(ups) == [0, 1, 2, 3, 4]
            assert [u.batch.events[0].block_hashes for u in ups] == [[i] for i in range(5)]
            for i in range(5, 9):
                p.publish(stored(i), 0.0)
            assert delivered(sub.catch_up("w0", 8)) == [5, 6, 7, 8]
            # Whatever the SUB socket still brings of these is skipped, never delivered twice.
            time.sleep(0.2)
            assert sub.poll() == [] and sub.next_seq("w0") == 9
            st = sub.stats()
            assert st.delivered == 9 and st.lost == 0 and st.replays >= 1
        finally:
            sub.close()


def test_a_history_the_buffer_no_longer_holds_is_lost_then_the_rest_follows():
    with pub(buffer=3) as p:
        for i in range(10):
            p.publish(stored(i), 0.0)
        sub = KVEventSubscriber()
        try:
            sub.follow("w0", p.endpoint)
            ups = sub.catch_up("w0", 9)
            assert ups[0] == Lost("w0", 0, 7) and delivered(ups) == [7, 8, 9]
            assert sub.stats().lost == 1
        finally:
            sub.close()


def test_many_publishers_on_one_subscriber_and_a_new_incarnation():
    a, b = pub(), pub()
    sub = KVEventSubscriber()
    try:
        sub.follow("a", a.endpoint)
        sub.follow("b", b.endpoint)
        a.publish(stored(1), 0.0)
        b.publish(stored(2), 0.0)
        b.publish(stored(3), 0.0)
        ups = sub.catch_up("a", 0) + sub.catch_up("b", 1)
        assert sorted((u.name, u.seq) for u in ups if isinstance(u, Delivered)) == [("a", 0), ("b", 0), ("b", 1)]
        # "a" restarts: a new publisher (another port), its seq from 0 again.
        a.close()
        a = pub()
        assert sub.follow("a", a.endpoint) and sub.next_seq("a") == 0
        a.publish(stored(4), 0.0)
        assert delivered(sub.catch_up("a", 0)) == [0]
        sub.unfollow("b")
        assert set(sub.followed()) == {"a"}
    finally:
        sub.close()
        a.close()
        b.close()


def test_a_publisher_that_does_not_answer_is_a_loss_not_a_hang():
    p = pub()
    sub = KVEventSubscriber(replay_timeout=0.3, backoff_s=60)
    try:
        sub.follow("w0", p.endpoint)
        ep = p.endpoint
        p.close()
        t = time.monotonic()
        ups = sub.catch_up("w0", 4)   # it said it published 0..4, and is gone
        assert time.monotonic() - t < 3 and ups == [Lost("w0", 0, 5)] and sub.followed() == {"w0": ep}
        # Not asked again while it stays quiet: later calls do not wait on it.
        t = time.monotonic()
        assert sub.catch_up("w0", 9) == [] and time.monotonic() - t < 0.2
    finally:
        sub.close()


# ---------------------------------------------------------------------------- the router's index

def _engine() -> Engine:
    # Small pools: the multi-turn traffic below evicts, tombstones windows and backs up to L2.
    return Engine.from_pretrained("strata-tiny", page_size=16, num_pages=96, max_batch_tokens=128,
                                  enable_prefix_cache=True,
                                  hicache=HiCacheConfig(host_pages=128, write_policy="write_through"))


def _serve(eng: Engine, stream: TreeEventStream, rng: random.Random, turns: int) -> None:
    """Multi-turn conversations on ``eng``, its tree's events published after every request."""
    convs: list[list[int]] = [[] for _ in range(3)]
    for _ in range(turns):
        c = rng.randrange(len(convs))
        convs[c] = (convs[c] + [rng.randrange(3, 250) for _ in range(rng.randrange(20, 90))])[-400:]
        out = eng.generate([convs[c]], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
        convs[c] += out.token_ids
        eng.cache.poll(block=True)
        stream.publish(eng.cache.take_events(), 0.0)


def _tree_blocks(eng: Engine) -> dict[tuple[str, str], set[int]]:
    """(tier, component) -> the block ids the worker's tree holds there."""
    out: dict[tuple[str, str], set[int]] = {}
    for ev in eng.cache.snapshot_events():
        out.setdefault((ev.tier, ev.component), set()).update(block_hash(k) for k in ev.page_keys)
    return out


def _index_blocks(router: Router, worker: str) -> dict[tuple[str, str], set[int]]:
    out = {}
    for tier in ("L1", "L2"):
        for comp, full in (("full", True), ("swa", False)):
            got = router.index.blocks(worker, tier, full)
            if got:
                out[(tier, comp)] = got
    return out


def test_the_router_rebuilds_a_tree_exactly_from_a_snapshot_after_losing_its_history():
    eng = _engine()
    geom = eng.geometry
    stream = TreeEventStream(KVEventPublisher(KVEventsConfig(host=HOST, buffer_batches=4), "m"),
                             WireMapping.of(16, geom.window or 0, worker_media()))
    sub = KVEventSubscriber()
    router = Router(RouterConfig(), geom)
    try:
        rng = random.Random(7)
        _serve(eng, stream, rng, 12)          # 12 batches: more than the buffer holds
        want = _tree_blocks(eng)
        assert want.get(("L1", "full")) and want.get(("L2", "full")) and want.get(("L1", "swa"))
        # A router that starts now: the replay no longer reaches back, so the history is lost...
        router.report("w0", "prefill", WorkerLoad(), True, now=0.0)
        sub.follow("w0", stream.endpoint)
        router.apply(sub.catch_up("w0", stream.position().seq))
        assert router.lost == 1 and router.take_resync("w0", 1.0) and not router.take_resync("w0", 1.5)
        assert router.rebuilding(1.5) == ["w0"] and router.take_resync("w0", 3.5)   # asked again
        assert router.rebuilding(3.6) == []     # ... but routing waits for the first snapshot only
        # ... and the worker's snapshot (what its report loop publishes when told to resync) repairs it.
        stream.snapshot(eng.cache.snapshot_events(), 0.0)
        router.apply(sub.catch_up("w0", stream.position().seq))
        assert _index_blocks(router, "w0") == want and router.rebuilding(3.6) == []
        # From there on the stream keeps it exact, through evictions, tombstones and L2 loads.
        _serve(eng, stream, rng, 6)
        router.apply(sub.catch_up("w0", stream.position().seq))
        assert _index_blocks(router, "w0") == _tree_blocks(eng)
        # A flush: its removals and AllBlocksCleared leave nothing.
        eng.flush_cache()
        stream.publish(eng.cache.take_events(), 0.0, cleared=True)
        router.apply(sub.catch_up("w0", stream.position().seq))
        assert _index_blocks(router, "w0") == {} and len(router.index) == 0
    finally:
        sub.close()
        stream.close()
        eng.close()


def test_the_router_reads_l3_only_from_the_l3_holder_and_skips_other_groups():
    router = Router(RouterConfig(), KVGeometry(16))
    router.report("w0", "colocated", WorkerLoad(), True, now=0.0)
    from storage.kv_events.subscriber import Delivered as D
    from storage.kv_events.wire import DISK, EventBatch
    router.apply([D("w0", 0, EventBatch(0.0, [BlockStored([1, 2], None, [], 16, medium=GPU, group_idx=0),
                                             BlockStored([9], None, [], 16, medium=GPU, group_idx=2)])),
                  D(L3_WORKER, 0, EventBatch(0.0, [BlockStored([1, 2, 3], None, [], 16, medium=DISK)]))])
    ov = router.index.overlap([1, 2, 3, 9], "w0", 0)
    assert ov.pages == 3 and ov.by_tier == {"L1": 2, "L2": 0, "L3": 1}
    router.apply([D(L3_WORKER, 1, EventBatch(0.0, [BlockRemoved([3], DISK)])),
                  D("w0", 1, EventBatch(0.0, [AllBlocksCleared()]))])
    assert router.index.overlap([1, 2, 3], "w0", 0).by_tier == {"L1": 0, "L2": 0, "L3": 2}
    router.apply([D("w0", 2, EventBatch(0.0, [BlockStored([1], None, [], 16, medium="TAPE")]))])
    assert router.index.overlap([1], "w0", 0).by_tier["L1"] == 0     # a medium it does not know: skipped


def test_routing_waits_for_a_restart_warmup_and_for_a_first_snapshot():
    import pytest

    from actors.routing import NoWorkerError
    from storage.kv_events.wire import EventBatch
    r = Router(RouterConfig(), KVGeometry(16), ready_at=1.0)
    r.report("p0", "prefill", WorkerLoad(), True, now=0.5)
    r.report("d0", "decode", WorkerLoad(free_pages=1), True, now=0.5)
    with pytest.raises(NoWorkerError, match="restarted"):   # retried by the ingress
        r.route([], 32, now=0.9)
    r.apply([Lost("p0", 0, 3)])
    assert r.take_resync("p0", 1.0)
    with pytest.raises(NoWorkerError, match="rebuilding its index of p0"):
        r.route([], 32, now=1.1)
    r.apply([Delivered("p0", 3, EventBatch(0.0, [AllBlocksCleared()]))])
    assert r.route([], 32, now=1.2).prefill == "p0" and r.status(1.2)["resync_pending"] == []


def test_skip_gives_up_a_long_history_for_a_snapshot():
    with pub() as p:
        for i in range(6):
            p.publish(stored(i), 0.0)
        sub = KVEventSubscriber()
        try:
            sub.follow("w0", p.endpoint)
            assert sub.skip("w0", 6) == [Lost("w0", 0, 6)] and sub.skip("w0", 3) == []
            p.publish(stored(6), 0.0)
            assert delivered(sub.catch_up("w0", 6)) == [6]
        finally:
            sub.close()
