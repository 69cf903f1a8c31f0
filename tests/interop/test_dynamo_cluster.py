"""NVIDIA Dynamo's KV indexer subscribed to a live strata cluster (2 prefill + 1 decode workers).

Dynamo's ``SelectionService`` (tests/interop/dynamo_index.py) reads only the two prefill workers' KV-event
streams (PUB + replay, as the router's status advertises them) and indexes them with its own decoder and
its own block hashes. A multi-turn run, one request at a time (conversations over a shared system prompt,
their first turns spread over both workers, each turn the previous prompt + answer + new user text, greedy,
an L1 small enough that pages move to L2, and a few "edited" turns that branch off an earlier prompt
mid-way) then checks before every request, once both sides have caught up:

- per prefill worker, Dynamo's overlap on the full-attention group equals strata's router's full-page
  overlap (its own index, walked without the sliding-window cut): device == L1, host - device == L2;
- for the worker the router then picks, strata's SWA-exact prediction (``meta_info.route
  .predicted_cached_tokens``) equals the hit the worker delivers (``meta_info.cached_tokens``), and Dynamo's
  full-only prediction is never below it: it counts pages whose window is gone (a tombstoned sliding
  window is invisible to Dynamo). The overestimate is printed;
- the delivered hit came from the tiers Dynamo names for that worker (``meta_info.cached_tokens_by_tier``:
  its first pages from the device prefix, the rest from the host tier).

The first turns are spread over both workers by draining the other one (the router's operator verb) while
each is sent: one request at a time, every conversation would follow the shared system prompt to the first.

L3 is off: it is shared and published by the storage actor as a stream of its own, which Dynamo would see
as one more worker, never as a prefill worker's tier; without it every hit comes from the worker's own L1
and L2, which is what both sides index here.

The router's index is read with its read-only query (``PrefixRouterActor.overlaps``); it is fed by the
same ZMQ streams Dynamo reads (strata's router consumes the wire too).

Encodings: the run is made twice, on a cluster publishing tagged maps (the default) and on one publishing
positional arrays (``kv_events.encoding``); both Dynamo and strata's router decode each.

Nothing talks to anything but 127.0.0.1.
"""
from __future__ import annotations

import dataclasses
import random
import time
from typing import NamedTuple

import pytest

from tests.interop.dynamo_index import AVAILABLE, SKIP_REASON, DynamoIndex, TierOverlap, WorkerStream

pytestmark = pytest.mark.skipif(not AVAILABLE, reason=SKIP_REASON)

httpx = pytest.importorskip("httpx")
ray = pytest.importorskip("ray")

PREFILL = ("prefill-0", "prefill-1")
DYNAMO_ID = {w: i for i, w in enumerate(PREFILL)}     # Dynamo names workers by int
ENCODINGS = ("tagged", "positional")    # one cluster per encoding

# Pools small enough that a prefill worker's L1 evicts during the run (write-through: the pages stay in L2),
# large enough for one request's prompt (<= ~430 tokens, 27 pages) on any worker, the decode one included.
NUM_PAGES = 40
HOST_PAGES = 56
CONVERSATIONS = 5
TURNS = 4
EDITS = 3
SYSTEM_TOKENS = 90       # shared by every conversation: both prefill workers come to hold it
MAX_NEW_TOKENS = 16
SETTLE_TIMEOUT_S = 15.0  # bounded wait for both indexes to catch up (this machine runs a suite beside it)


@pytest.fixture(scope="module", params=ENCODINGS)
def cluster(request, tmp_path_factory):
    from cluster import launch  # sets the Ray environment (loopback, no token auth) on import
    from cluster.config import load_config
    from tests.util import free_port

    cfg = load_config("cluster/configs/pd-2p1d.yaml")
    hicache = dataclasses.replace(cfg.engine.hicache, host_pages=HOST_PAGES, l3=None)
    engine = dataclasses.replace(cfg.engine, num_pages=NUM_PAGES, hicache=hicache)
    # Every turn goes to a prefill worker, whose index the two consumers are compared on (none is prefilled on
    # the decode worker that holds it: conditional disaggregation, tests/e2e/test_cluster_http.py).
    cfg = dataclasses.replace(cfg, engine=engine,
                              kv_events=dataclasses.replace(cfg.kv_events, enabled=True, host="127.0.0.1",
                                                            encoding=request.param),
                              server=dataclasses.replace(cfg.server, host="127.0.0.1", port=free_port()),
                              router=dataclasses.replace(cfg.router, local_prefill_tokens=0))
    launch.init_ray(cfg)
    handles = launch.deploy(cfg)
    try:
        yield handles
    finally:
        launch.shutdown(handles)
        ray.shutdown()


@pytest.fixture(scope="module")
def dynamo(cluster):
    """Dynamo subscribed to the prefill workers' streams only, found through the router's status."""
    endpoints = ray.get(cluster["router"].status.remote(), timeout=30)["kv_events"]
    for w in PREFILL:   # the worker says the same itself
        assert ray.get(cluster["workers"][w].kv_events_endpoint.remote(), timeout=30)._asdict() == endpoints[w]
    for ep in endpoints.values():
        assert ep["pub"].startswith("tcp://127.0.0.1:") and ep["replay"].startswith("tcp://127.0.0.1:"), ep
    page = cluster["engine_config"].page_size
    with DynamoIndex([WorkerStream(DYNAMO_ID[w], endpoints[w]["pub"], endpoints[w]["replay"]) for w in PREFILL],
                     block_size=page) as index:
        yield index


# ---- strata's side ------------------------------------------------------------------------------------

def _router_overlaps(router, keys: list[int]) -> dict[str, tuple[dict, int]]:
    """Per prefill worker, from the router actor's own index: (full-page overlap by tier, walked without the
    SWA cut, as Dynamo's full-only index does; the SWA-exact usable pages the router routes by)."""
    full = ray.get(router.overlaps.remote(keys, list(PREFILL), window=False), timeout=30)
    exact = ray.get(router.overlaps.remote(keys, list(PREFILL)), timeout=30)
    return {w: (dict(full[w].by_tier), exact[w].pages) for w in PREFILL}


def _as_dynamo(by_tier: dict) -> TierOverlap:
    """strata's per-tier full-page counts in Dynamo's cumulative form: device = L1, host = L1 + L2, and
    disk = host (no L3 here: a prefill worker has no disk blocks, so the prefix ends at the host tier)."""
    assert by_tier["L3"] == 0, by_tier     # no L3 in this cluster
    host = by_tier["L1"] + by_tier["L2"]
    return TierOverlap(by_tier["L1"], host, host)


def _settled(dynamo: DynamoIndex, router, tokens: list[int], keys: list[int]):
    """Both indexes' views of one prompt (``tokens`` for Dynamo, their page ``keys`` for strata) once they
    have caught up with the workers' events: polled until Dynamo's overlaps and the router's full-page
    overlaps agree and stay unchanged for two more polls 0.1 s apart (past the workers' 50 ms report
    interval), or until the bound; -> the last (Dynamo's, strata's full-page in Dynamo's form, strata's
    SWA-exact pages), for the caller to assert on."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    last, stable = None, 0
    while True:
        dyn = dynamo.overlaps(tokens)
        strata = _router_overlaps(router, keys)
        view = ({DYNAMO_ID[w]: _as_dynamo(strata[w][0]) for w in PREFILL}, dyn)
        stable = stable + 1 if view == last else 0
        last = view
        if (view[0] == view[1] and stable >= 2) or time.monotonic() >= deadline:
            return dyn, view[0], {w: strata[w][1] for w in PREFILL}
        time.sleep(0.1)


# ---- the run ------------------------------------------------------------------------------------------

def _generate(url: str, ids: list[int]) -> dict:
    r = httpx.post(f"{url}/generate", timeout=120, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0,
                                              "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


class Row(NamedTuple):
    """One request: what each index said before it was sent, and what the router and the worker did.
    Token counts (Dynamo's blocks times the page size)."""
    name: str
    prompt: int
    dynamo: dict[str, TierOverlap]      # per prefill worker, blocks
    strata: dict[str, TierOverlap]      # the router's full-page overlap in Dynamo's form, blocks
    strata_exact: dict[str, int]        # the router's SWA-exact usable pages
    worker: str                         # the prefill worker the router chose
    predicted: int                      # meta_info.route.predicted_cached_tokens
    delivered: int                      # meta_info.cached_tokens
    delivered_by_tier: dict[str, int]   # meta_info.cached_tokens_by_tier: where the worker found them
    page: int

    @property
    def dynamo_tokens(self) -> int:
        """Dynamo's full-only prediction for the chosen worker: its prefix on device or host."""
        return self.dynamo[self.worker].host * self.page

    @property
    def dynamo_split(self) -> dict[str, int]:
        """The delivered hit split as Dynamo's tiers for the chosen worker say: its first pages from the
        device prefix, the rest from the host."""
        l1 = min(self.delivered, self.dynamo[self.worker].device * self.page)
        return {"L1": l1, "L2": self.delivered - l1, "L3": 0}


def test_dynamo_indexes_the_prefill_workers_as_strata_s_router_does(cluster, dynamo):
    from actors.routing import prompt_blocks

    url, router = cluster["url"], cluster["router"]
    geom = ray.get(router.geometry.remote(), timeout=30)
    rcfg = ray.get(router.config.remote(), timeout=30)
    page = geom.page_size
    assert page == dynamo.block_size == 16 and geom.window_pages > 0   # strata-tiny: hybrid, window 64
    rng = random.Random(3636)
    text = lambda n: [rng.randrange(3, cluster["model_config"].vocab_size) for _ in range(n)]   # noqa: E731

    def observe(ids: list[int]) -> tuple:
        # Both sides are asked about the same pages: the prompt's cacheable ones (strata always computes
        # the last token, so a page ending at the prompt's end is never a hit).
        dyn, full, exact = _settled(dynamo, router, ids[:geom.cacheable_tokens(len(ids))],
                                    prompt_blocks(ids, geom, rcfg))
        by_name = {w: DYNAMO_ID[w] for w in PREFILL}
        return ({w: dyn[i] for w, i in by_name.items()}, {w: full[i] for w, i in by_name.items()}, exact)

    rows: list[Row] = []

    def record(name: str, ids: list[int], seen: tuple, out: dict) -> list[int]:
        """One request sent after ``seen`` = observe(ids) (nothing else runs meanwhile); -> its answer."""
        meta = out["meta_info"]
        rows.append(Row(name, len(ids), *seen, meta["route"]["prefill"],
                        meta["route"]["predicted_cached_tokens"], meta["cached_tokens"],
                        meta["cached_tokens_by_tier"], page))
        return out["output_ids"]

    # Turn 0: the conversations alternate between the workers. One request at a time, each would follow
    # the shared system prompt to the first worker, so every other one is sent while that worker is
    # drained (the router's operator verb: no new requests, its cache still indexed) and restored after.
    system = text(SYSTEM_TOKENS)
    prompts = [system + text(rng.randrange(60, 120)) for _ in range(CONVERSATIONS)]
    answers = []
    for c, p in enumerate(prompts):
        away = PREFILL[(c + 1) % 2]
        assert ray.get(router.drain.remote(away), timeout=30)
        try:
            answers.append(record(f"conv {c} turn 0", p, observe(p), _generate(url, p)))
        finally:
            ray.get(router.restore_worker.remote(away), timeout=30)
        assert rows[-1].worker == PREFILL[c % 2], rows[-1]
    # Then turns interleaved across the conversations (so both workers fill and evict), each the previous
    # prompt + answer + new user text; the router routes freely (the conversations stay where they hit).
    history: list[list[int]] = list(prompts)
    for turn in range(1, TURNS):
        for c in range(CONVERSATIONS):
            prompts[c] = prompts[c] + answers[c] + text(rng.randrange(30, 70))
            answers[c] = record(f"conv {c} turn {turn}", prompts[c], observe(prompts[c]),
                                _generate(url, prompts[c]))
            history.append(prompts[c])
    # "Edited" turns: an earlier prompt cut mid-way (not at a page end) plus new text, which hits inside a
    # cached sequence, where the sliding window may be gone while the full pages stay.
    for e in range(EDITS):
        base = history[rng.randrange(CONVERSATIONS, len(history))]
        ids = base[:rng.randrange(len(base) // 2, len(base) - 20)] + text(25)
        record(f"edit {e}", ids, observe(ids), _generate(url, ids))

    print("\nrequest        prompt  worker     dynamo  strata  delivered   dynamo (device, host) per prefill worker")
    for r in rows:
        print(f"{r.name:<14} {r.prompt:>6}  {r.worker:<10} {r.dynamo_tokens:>6}  {r.predicted:>6}  "
              f"{r.delivered:>9}   {({w: tuple(o[:2]) for w, o in r.dynamo.items()})}")
    over = [r.dynamo_tokens - r.delivered for r in rows]
    print(f"Dynamo's full-only prediction for the chosen worker over the delivered hit: +{sum(over)} tokens on "
          f"{sum(o > 0 for o in over)} of {len(over)} requests (delivered {sum(r.delivered for r in rows)} "
          f"cached tokens); strata's SWA-exact prediction: off by "
          f"{sum(abs(r.predicted - r.delivered) for r in rows)}")

    # Dynamo, fed only by the prefill workers' ZMQ streams, indexes them as strata's router does.
    bad = [r for r in rows if r.dynamo != r.strata]
    assert not bad, "\n".join(f"{r.name}: dynamo {r.dynamo} != strata {r.strata}" for r in bad)
    # strata's router predicts exactly the hit the chosen worker delivers (SWA-exact); the router's
    # prediction is what its index said just before (nothing ran in between).
    assert [r.predicted for r in rows] == [r.delivered for r in rows], rows
    assert [r.predicted for r in rows] == [r.strata_exact[r.worker] * page for r in rows], rows
    # Dynamo, blind to sliding windows, never predicts less than is delivered, and here more: some
    # windows were evicted (an edit hits mid-sequence, where only kept windows stay) while full pages stayed.
    assert all(o >= 0 for o in over), rows
    # Where the delivered pages came from is where Dynamo's tiers put them (L1 evicts leaves first, so a
    # worker's device pages are a prefix of what it holds).
    assert [r.delivered_by_tier for r in rows] == [r.dynamo_split for r in rows], rows
    assert sum(over) > 0, "no window was gone where Dynamo counted full pages: the SWA pool is too large"
    # The run exercised what it claims: hits on both workers, and pages on the host tier only.
    assert {r.worker for r in rows if r.delivered} == set(PREFILL), rows
    assert any(r.delivered_by_tier["L2"] for r in rows), \
        "no hit came from the host tier: the L1 pool is too large for this run"
