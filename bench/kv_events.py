"""What publishing the KV-event wire costs (storage/kv_events/): the tree events of bench/tree.py's
multi-turn workload (100 conversations x 6 rounds, page 16, window 128, L1 only), one batch per request
as a worker's report thread takes them, translated and published on a real ZMQ PUB on 127.0.0.1 with one
SUB receiving everything (in another process, so its CPU is not counted here). Per encoding: batches/s,
events/s and blocks/s published, microseconds and bytes per batch, and the publisher's CPU (this process:
translation, msgpack, ZMQ's I/O thread) against the tree's own CPU for the same requests.
The router's side of the same stream (``consume``): strata's router consumes the wire (storage/kv_events/
subscriber.py into actors/prefix_router.Router), so per encoding also: publish + catch-up per batch, as
a worker's report makes the router apply everything published before it (``live_us/batch``); a restarted
router rebuilding from the replay of the whole history (``replay_ms``) and from one snapshot of the final
tree (``snapshot_ms``), each checked to give the same index.
Writes bench/results/kv_events.json.

    python -m bench.kv_events [--reps 3]
"""
from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import time

from bench import tree as tb
from bench.common import table, write_json
from engine.worker_load import WorkerLoad
from storage.geometry import KVGeometry
from storage.kv_events import (POSITIONAL, TAGGED, KVEventPublisher, KVEventsConfig, TreeEventStream, WireMapping,
                               worker_media)


def _subscriber(addr: str, want: int, ready, done) -> None:
    import zmq
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(addr)
    ready.set()
    n = 0
    while n < want:
        if sub.poll(10_000):
            sub.recv_multipart()
            n += 1
        else:
            break
    done.value = n
    ctx.destroy(linger=0)


def batches() -> tuple[list[list], float, list]:
    """The tree events of the workload, one batch per request, the tree's CPU seconds for them, and the
    tree's final state as stored events (its snapshot)."""
    rounds = tb.workload()
    full, swa = tb.pool_sizes(rounds)
    geom = KVGeometry(tb.PAGE, tb.WINDOW)
    cache = tb.BareTree(full, swa, geom)
    tm = tb._Timers()
    out, now = [], 0.0
    tb._clock = "cpu"
    t0 = time.process_time()
    for rnd in rounds:
        for tokens in rnd:
            now += 1.0
            tb.serve(cache, tokens, now, tm)
            out.append(cache.tree.take_events())
    return out, time.process_time() - t0, cache.tree.snapshot_events()


def publish_all(evs: list[list], encoding: str) -> dict:
    cfg = KVEventsConfig(host="127.0.0.1", encoding=encoding, buffer_batches=10_000, send_hwm=0)
    stream = TreeEventStream(KVEventPublisher(cfg, "bench"), WireMapping.of(tb.PAGE, tb.WINDOW, worker_media()))
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Value("i", 0)
    want = sum(1 for b in evs if b)
    proc = ctx.Process(target=_subscriber, args=(stream.endpoint.pub, want, ready, done))
    proc.start()
    ready.wait(30)
    time.sleep(1.0)   # the subscription reaches the PUB
    c0, w0 = time.process_time(), time.perf_counter()
    size = 0
    for b in evs:
        stream.publish(b, 0.0)
    wall = time.perf_counter() - w0
    proc.join(60)
    cpu = time.process_time() - c0   # ZMQ's I/O thread included, until the subscriber had everything
    st = stream.stats()
    with stream.publisher._lock:
        size = sum(len(p) for _, p in stream.publisher._buffer)
    stream.close()
    blocks = sum(len(e.page_keys) for b in evs for e in b)
    return {"encoding": encoding, "batches": st.batches, "received": done.value, "events": st.events,
            "blocks": blocks, "batches/s": round(st.batches / wall), "events/s": round(st.events / wall),
            "blocks/s": round(blocks / wall), "us/batch": round(wall / st.batches * 1e6, 1),
            "bytes/batch": round(size / max(1, min(st.batches, 10_000))), "cpu_s": round(cpu, 4)}


def consume_all(evs: list[list], final: list, encoding: str) -> dict:
    """The router's side: ``evs`` published one batch at a time, each applied before the next (a report's
    barrier); then a new router rebuilt from the replay, and another from a snapshot of ``final`` (the
    tree's state at the end, as stored events)."""
    from actors.prefix_router import Router
    from actors.routing import RouterConfig
    from storage.kv_events import KVEventSubscriber

    geom = KVGeometry(tb.PAGE, tb.WINDOW)
    cfg = KVEventsConfig(host="127.0.0.1", encoding=encoding, buffer_batches=10_000, send_hwm=0)
    stream = TreeEventStream(KVEventPublisher(cfg, "bench"), WireMapping.of(tb.PAGE, tb.WINDOW, worker_media()))

    def router() -> tuple:
        r, sub = Router(RouterConfig(), geom), KVEventSubscriber()
        r.report("w", "prefill", WorkerLoad(), True, 0.0)
        sub.follow("w", stream.endpoint)
        return r, sub
    live, sub = router()
    time.sleep(0.5)   # the subscription reaches the PUB
    w0 = time.perf_counter()
    for b in evs:
        seq = stream.publish(b, 0.0)
        if seq >= 0:
            live.apply(sub.catch_up("w", seq))
    live_s = time.perf_counter() - w0
    last = stream.position().seq
    replayed, sub2 = router()
    w0 = time.perf_counter()
    replayed.apply(sub2.catch_up("w", last))
    replay_s = time.perf_counter() - w0
    # The rebuild a router makes when the replay no longer reaches back: the snapshot alone.
    snap_stream = TreeEventStream(KVEventPublisher(dataclasses.replace(cfg, buffer_batches=1), "bench"),
                                  stream.mapping)
    snap_stream.snapshot(final, 0.0)
    snap, sub3 = Router(RouterConfig(), geom), KVEventSubscriber()
    sub3.follow("w", snap_stream.endpoint)
    w0 = time.perf_counter()
    snap.apply(sub3.catch_up("w", 0))
    snapshot_s = time.perf_counter() - w0
    snap_stream.close()
    blocks = {t: live.index.blocks("w", t) for t in ("L1", "L2")}
    assert blocks == {t: replayed.index.blocks("w", t) for t in blocks} == {t: snap.index.blocks("w", t) for t in blocks}
    for s_ in (sub, sub2, sub3):
        s_.close()
    stream.close()
    n = sum(1 for b in evs if b)
    return {"encoding": encoding, "indexed_pages": len(live.index), "live_us/batch": round(live_s / n * 1e6, 1),
            "replay_ms": round(replay_s * 1e3, 1), "replay_events/s": round(sum(len(b) for b in evs) / replay_s),
            "snapshot_events": len(final), "snapshot_ms": round(snapshot_s * 1e3, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    evs, tree_cpu, final = batches()
    rows = []
    for enc in (TAGGED, POSITIONAL):
        runs = [publish_all(evs, enc) for _ in range(args.reps)]
        best = min(runs, key=lambda r: r["cpu_s"])
        best["cpu_vs_tree"] = round(best["cpu_s"] / tree_cpu, 3)
        rows.append(best)
    print(f"tree CPU for the same {len(evs)} requests: {tree_cpu:.3f} s")
    cols = ["encoding", "batches", "received", "events/s", "blocks/s", "us/batch", "bytes/batch", "cpu_s", "cpu_vs_tree"]
    print(table(rows, cols))
    consume = [min((consume_all(evs, final, enc) for _ in range(args.reps)), key=lambda r: r["live_us/batch"])
               for enc in (TAGGED, POSITIONAL)]
    print(table(consume, ["encoding", "indexed_pages", "live_us/batch", "replay_ms", "replay_events/s",
                          "snapshot_events", "snapshot_ms"]))
    write_json("kv_events", {"workload": "bench/tree.py (100 conversations x 6 rounds, page 16, window 128)",
                             "requests": len(evs), "tree_cpu_s": round(tree_cpu, 4), "rows": rows,
                             "consume": consume})


if __name__ == "__main__":
    main()
