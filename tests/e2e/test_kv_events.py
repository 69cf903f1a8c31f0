"""The KV-event wire on the real cluster (2 prefill + 1 decode workers, file L3; kv_events on by default):
every worker and the L3 storage actor publish on their own sockets, found through the router's status;
a SUB sees BlockStored for a prompt's pages after a request (L1 on a worker, DISK from the storage actor),
a replay from seq 0 gives the same history, and /flush_cache brings AllBlocksCleared from each."""
import random
import time

import httpx
import ray
import zmq

from engine.model.tokenizer import TextTokenizer
from storage.hashing import page_keys
from storage.kv_events import (CPU, DISK, GPU, END_OF_REPLAY, FULL_ATTENTION, AllBlocksCleared, BlockStored,
                               block_hash, decode_batch, decode_seq, encode_seq)

PAGE = 16   # cluster/configs/pd-2p1d.yaml's page_size


def _prompt(seed: int, n: int = 500) -> str:
    rnd = random.Random(seed)
    return "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))


def _drain(subs: dict, until, timeout: float = 30.0) -> dict:
    """Receive from every SUB (publisher -> socket) into publisher -> [events] until ``until(got)``."""
    got: dict = {p: [] for p in subs}
    poller = zmq.Poller()
    for s in subs.values():
        poller.register(s, zmq.POLLIN)
    deadline = time.monotonic() + timeout
    while not until(got):
        assert time.monotonic() < deadline, f"the events never came: {({p: len(e) for p, e in got.items()})}"
        for sock, _ in poller.poll(200):
            topic, seq, payload = sock.recv_multipart()
            p = next(p for p, s in subs.items() if s is sock)
            got[p] += decode_batch(payload).events
    return got


def _stored(events, *media: str) -> set:
    return {h for e in events if isinstance(e, BlockStored) and e.medium in media and e.group_idx == 0
            and e.kv_cache_spec_kind == FULL_ATTENTION for h in e.block_hashes}


def test_workers_and_l3_publish_the_prompt_and_the_flush(cluster):
    url, router = cluster["url"], cluster["router"]
    endpoints = ray.get(router.status.remote())["kv_events"]
    assert set(endpoints) == {"prefill-0", "prefill-1", "decode-0", "L3"}, endpoints
    for p, ep in endpoints.items():
        assert ep["topic"].startswith("kv@127.0.0.1:") and ep["topic"].endswith("@strata-tiny"), ep
        assert ep["pub"].startswith("tcp://127.0.0.1:") and ep["replay"].startswith("tcp://127.0.0.1:")
    for w, h in cluster["workers"].items():   # the worker says the same itself
        assert ray.get(h.kv_events_endpoint.remote())._asdict() == endpoints[w]
    ctx = zmq.Context()
    try:
        subs = {}
        for p, ep in endpoints.items():
            s = subs[p] = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, ep["topic"].encode())
            s.connect(ep["pub"])
        time.sleep(1.0)   # a SUB misses what is published before its subscription reaches the PUB
        text = _prompt(11)
        ids = TextTokenizer(cluster["model_path"]).encode(text)
        want = {block_hash(k) for k in page_keys(ids, PAGE)[:(len(ids) - 1) // PAGE]}
        r = httpx.post(f"{url}/generate", timeout=120,
                       json={"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        assert r.status_code == 200, r.text

        def seen(got) -> bool:
            on_workers = set().union(*(_stored(got[w], CPU, GPU) for w in got if w != "L3"))
            return want <= on_workers and want <= _stored(got["L3"], DISK)
        got = _drain(subs, seen)
        # The sliding component is group 1 with the model's window (strata-tiny is a hybrid model).
        window = ray.get(router.geometry.remote()).window
        assert window and any(isinstance(e, BlockStored) and e.group_idx == 1 and e.kv_cache_spec_kind == "sliding_window"
                              and e.kv_cache_spec_sliding_window == window for w in got for e in got[w])
        # L1 and L2 are each worker's own; L3 only ever comes from the storage actor.
        assert all(e.medium != DISK for w in got if w != "L3" for e in got[w] if hasattr(e, "medium"))
        # The replay socket holds the recent history (the package's clusters keep 32 batches), contiguous by
        # seq, closed by -1.
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 10_000)
        dealer.connect(endpoints["L3"]["replay"])
        dealer.send_multipart([b"", encode_seq(0)])
        replayed, seqs = [], []
        while (frames := dealer.recv_multipart())[1] != END_OF_REPLAY:
            seqs.append(decode_seq(frames[1]))
            replayed += decode_batch(frames[2]).events
        assert seqs and seqs == list(range(seqs[0], seqs[0] + len(seqs))) and want <= _stored(replayed, DISK)

        deadline = time.monotonic() + 60
        while (f := httpx.post(f"{url}/flush_cache", timeout=60)).status_code == 409:
            assert time.monotonic() < deadline, f.text
            time.sleep(0.5)
        assert f.status_code == 200 and f.json()["flushed"], f.text
        _drain(subs, lambda got: all(any(isinstance(e, AllBlocksCleared) for e in got[p]) for p in got))
    finally:
        ctx.destroy(linger=0)
