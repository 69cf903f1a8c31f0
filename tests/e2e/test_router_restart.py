"""The router actor killed under load, on the shared 2 prefill + 1 decode cluster whose workers keep a
replay buffer far smaller than the history they published (tests/e2e/conftest.py): the restarted router
rebuilds its index from the workers' KV-event streams (replay, then the snapshots it asks for), the index
then equals the workers' trees, prefix routing finds the conversations cached before the kill as it found
them before, and no answer has a wrong token. The ingress asks the router over its route channel
(actors/route_channel.py) before the kill and, once it found the new endpoint, after it.

Runs last of the package (file order) so no other test sees the restart; the cluster is left healthy."""
from __future__ import annotations

import os
import random
import threading
import time

import httpx
import pytest
import ray

from engine import Engine, SamplingParams
from tests import numerics

pytestmark = [pytest.mark.slow, pytest.mark.numerics]

# Seconds from the kill until the index equals the trees again. It counts the load's 6 remaining turns
# after the kill too (the clients are joined first), which alone took ~4-5 s on a 2-core machine 3x slower
# than the one 5.0 was set on (5.37 s there, CI at c9d5d2b): seconds, not the 60 s of a failed rebuild.
REBUILD_BOUND_S = 10.0
NEW = 6          # tokens generated per turn
TURN = 48        # new prompt tokens per turn
LOAD_TURNS = 8   # turns of each load client (the router is killed after their second)
REPORT_GAP_S = 0.15   # three report intervals (WorkerActor reports every 50 ms)


def _generate(url: str, ids: list[int]) -> dict:
    r = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


class Conversations:
    """Multi-turn conversations over HTTP; every answer kept for the judge."""

    def __init__(self, url: str, vocab: int, n: int, seed: int) -> None:
        self.url, self.rng = url, random.Random(seed)
        self.vocab = vocab
        self.convs = [self._text(160) for _ in range(n)]
        self.answers: list[tuple[list[int], list[int], dict]] = []
        self.lock = threading.Lock()

    def _text(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def turn(self, c: int) -> dict:
        prompt = list(self.convs[c])
        out = _generate(self.url, prompt)
        with self.lock:
            self.answers.append((prompt, out["output_ids"], out["meta_info"]))
            self.convs[c] = prompt + out["output_ids"] + self._text(TURN)
        return out["meta_info"]


def _measured(conv: "Conversations") -> list[dict]:
    """Two more turns of each of ``conv``'s conversations, one at a time, each after the workers' next
    report: a route counts its prompt against its worker until that worker reports (to spread a burst),
    so turns sent back to back would be split between the workers by that count as well as by their
    caches, and the hit rate would measure how fast the cluster answers."""
    out = []
    for _ in range(2):
        for c in range(len(conv.convs)):
            time.sleep(REPORT_GAP_S)
            out.append(conv.turn(c))
    return out


def _own_hit(metas: list[dict]) -> float:
    """Prompt tokens served from the prefill worker's own tiers (L1 + L2) over all prompt tokens: what
    routing to the worker that holds the conversation buys (L3 serves every worker alike)."""
    own = sum(m["cached_tokens_by_tier"]["L1"] + m["cached_tokens_by_tier"]["L2"] for m in metas)
    return own / sum(m["prompt_tokens"] for m in metas)


def _index_matches_trees(router, workers: dict) -> tuple[bool, dict]:
    """Whether the router's index holds, per worker and tier, exactly the blocks its tree holds."""
    diff = {}
    for w, h in workers.items():
        tree = ray.get(h.cached_blocks.remote(), timeout=30)
        index = ray.get(router.indexed_blocks.remote(w), timeout=30)
        if tree != index:
            diff[w] = {t: {c: (len(tree.get(t, {}).get(c, [])), len(index.get(t, {}).get(c, [])))
                           for c in ("full", "swa")} for t in ("L1", "L2")}
    return not diff, diff


def test_router_killed_under_load_rebuilds_its_index_and_routing(cluster):
    url, router, workers = cluster["url"], cluster["router"], cluster["workers"]
    vocab = cluster["model_config"].vocab_size
    a = Conversations(url, vocab, 6, seed=3737)    # measured before the kill
    b = Conversations(url, vocab, 6, seed=3838)    # cached before the kill, measured after it
    for c in range(6):
        a.turn(c)
        b.turn(c)
    before = _measured(a)
    st = ray.get(router.status.remote(), timeout=30)
    pages_before = st["indexed_pages"]
    channel_before = st["route_channel"]
    assert channel_before["answered"] >= len(before), channel_before   # the ingress asks over ZMQ

    # Load: clients keep conversations of their own going while the router is killed. A fixed number of
    # turns, with the kill after the first ones: how much the load caches (and so evicts of b's
    # conversations from the workers' own tiers) must not depend on how fast the cluster serves.
    load = Conversations(url, vocab, 4, seed=3939)
    errors: list[str] = []
    started = threading.Barrier(5)

    def client(c: int) -> None:
        for i in range(LOAD_TURNS):
            try:
                if i == 2:
                    started.wait(timeout=120)   # every client is into its load: the kill lands under load
                load.turn(c)
            except threading.BrokenBarrierError:
                return      # another client failed: reported below
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))
                started.abort()
                return

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(4)]
    for t in threads:
        t.start()
    pid = ray.get(router.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    try:
        started.wait(timeout=120)
    except threading.BrokenBarrierError:
        pass        # a client failed: its error is asserted below
    t_kill = time.monotonic()
    ray.kill(router, no_restart=False)
    time.sleep(1.0)          # in flight meanwhile: routes are retried by Ray on the restarted actor
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors

    # Rebuilt: the index equals the workers' trees again (the streams' replay no longer reaches back).
    while True:
        try:
            alive = ray.get(router.__ray_call__.remote(lambda self: os.getpid()), timeout=5) != pid
        except ray.exceptions.RayError:
            alive = False
        ok, diff = _index_matches_trees(router, workers) if alive else (False, {})
        if ok:
            break
        assert time.monotonic() - t_kill < 60, diff
        time.sleep(0.05)
    rebuild_s = time.monotonic() - t_kill
    st = ray.get(router.status.remote(), timeout=30)
    feed = st["kv_events_feed"]
    print({"rebuild_s": round(rebuild_s, 2), "pages_before": pages_before, "pages_after": st["indexed_pages"],
           "feed": feed})
    assert feed["lost"] >= 1, feed     # the buffer was smaller than the history: snapshots rebuilt it
    assert st["indexed_pages"] > 0 and not st["resync_pending"], st
    assert rebuild_s <= REBUILD_BOUND_S, rebuild_s

    # Routing is back: b's conversations, cached before the kill, are found where they are, as a's were.
    after = _measured(b)
    hit_before, hit_after = _own_hit(before), _own_hit(after)
    print({"own_tier_hit_before": round(hit_before, 3), "own_tier_hit_after": round(hit_after, 3)})
    assert hit_after >= hit_before - 0.02, (hit_before, hit_after)
    # The ingress found the restarted router's new route channel (a request or so per replica went over
    # Ray while it did).
    channel_after = ray.get(router.status.remote(), timeout=30)["route_channel"]
    assert channel_after["endpoint"] != channel_before["endpoint"], channel_after
    assert channel_after["answered"] >= len(after) - 4, channel_after
    # One request at a time: the router's prediction is the delivered hit, token for token.
    for m in after:
        assert m["route"]["predicted_cached_tokens"] == m["cached_tokens"], m

    # No wrong token: every answer of the run against an offline engine (the numerics policy).
    ref = Engine.from_pretrained(cluster["model_path"], page_size=16, num_pages=512)
    try:
        for conv in (a, b, load):
            for prompt, got, _meta in conv.answers:
                want = ref.generate([prompt], SamplingParams(max_new_tokens=NEW, ignore_eos=True,
                                                             return_logits=True))[0]
                numerics.assert_same_output(got, want, ref.model_config, "after a router restart")
    finally:
        ref.close()
