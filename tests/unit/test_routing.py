"""The pure prefix index and route policy (no Ray)."""
import pytest

from actors.routing import L3_WORKER, NoWorkerError, PrefixIndex, RouterConfig, pick_decode, prompt_blocks, prompt_keys, route
from engine.worker_load import WorkerLoad
from storage.radix.node import KVEvent
from storage.geometry import KVGeometry


def ev(kind, tier, comp, keys):
    return KVEvent(kind, tier, comp, tuple(keys))


CFG = RouterConfig()
GEOM = KVGeometry(page_size=4, window=8)   # window_pages = ceil(7 / 4) = 2
TOKS = list(range(41))          # 10 usable pages (the last token is always computed)
KEYS = prompt_keys(TOKS, GEOM, CFG)
BLOCKS = prompt_blocks(TOKS, GEOM, CFG)


def test_prompt_keys_leave_the_last_token_out():
    assert len(KEYS) == 10
    assert len(prompt_keys(list(range(40)), GEOM, CFG)) == 9


def test_overlap_needs_the_swa_window_at_the_cut():
    idx = PrefixIndex()
    idx.apply("p0", [ev("stored", "L1", "full", KEYS[:8]), ev("stored", "L1", "swa", KEYS[5:8])])
    ov = idx.overlap(BLOCKS, "p0", 2)
    assert ov.pages == 8 and ov.by_tier["L1"] == 8
    # Without SWA data anywhere the full pages alone are not usable (the window would be missing).
    idx2 = PrefixIndex()
    idx2.apply("p0", [ev("stored", "L1", "full", KEYS[:8])])
    assert idx2.overlap(BLOCKS, "p0", 2).pages == 0
    assert idx2.overlap(BLOCKS, "p0", 0).pages == 8
    # A tombstoned page cuts the usable prefix back to the last point with a complete window.
    idx.apply("p0", [ev("removed", "L1", "swa", KEYS[7:8]), ev("stored", "L2", "swa", KEYS[2:4])])
    assert idx.overlap(BLOCKS, "p0", 2).pages == 7          # pages 5, 6 still hold SWA
    idx.apply("p0", [ev("removed", "L1", "swa", KEYS[6:7])])
    assert idx.overlap(BLOCKS, "p0", 2).pages == 4          # pages 2, 3 (from L2) do


def test_l3_serves_every_worker_and_removal_events_are_honoured():
    idx = PrefixIndex()
    idx.apply(L3_WORKER, [ev("stored", "L3", "full", KEYS[:6]), ev("stored", "L3", "swa", KEYS[4:6])])
    for w in ("p0", "p1"):
        ov = idx.overlap(BLOCKS, w, 2)
        assert ov.pages == 6 and ov.by_tier["L3"] == 6
    idx.apply(L3_WORKER, [ev("removed", "L3", "full", KEYS[3:6])])
    assert idx.overlap(BLOCKS, "p0", 2).pages == 0   # the window before page 3 has no SWA data


def test_route_prefers_the_worker_holding_the_prefix_until_load_outweighs_it():
    idx = PrefixIndex()
    idx.apply("p1", [ev("stored", "L1", "full", KEYS), ev("stored", "L1", "swa", KEYS[-2:])])
    loads = {"p0": WorkerLoad(queued_tokens=0, running=0), "p1": WorkerLoad(queued_tokens=0, running=0)}
    w, ov = route(idx, BLOCKS, len(TOKS), loads, CFG, GEOM)
    assert w == "p1" and ov.pages == 10
    busy = {"p0": WorkerLoad(queued_tokens=0, running=0), "p1": WorkerLoad(queued_tokens=5000, running=3)}
    assert route(idx, BLOCKS, len(TOKS), busy, CFG, GEOM)[0] == "p0"
    idx.drop_worker("p1")
    assert len(idx) == 0 and route(idx, BLOCKS, len(TOKS), loads, CFG, GEOM)[0] == "p0"


def test_pick_decode_and_errors():
    assert pick_decode({"d0": WorkerLoad(free_pages=10, running=4),
                        "d1": WorkerLoad(free_pages=10, running=0)}) == "d1"
    # Of equals, the first listed: a stable choice between idle decode workers.
    same = WorkerLoad(free_pages=10, running=1)
    assert pick_decode({"d1": same, "d0": same, "d2": WorkerLoad(free_pages=9, running=1)}) == "d1"
    assert pick_decode({"d0": same, "d1": same}) == "d0"
    # No live worker is its own error: the ingress waits it out after a router restart.
    with pytest.raises(NoWorkerError, match="no decode worker"):
        pick_decode({})
    with pytest.raises(NoWorkerError, match="no prefill worker"):
        route(PrefixIndex(), BLOCKS, 41, {}, CFG, GEOM)
    with pytest.raises(ValueError, match="l2_weight"):
        RouterConfig(l2_weight=-1)


def _holders(idx: PrefixIndex, full: bool, key) -> dict[str, set[str]]:
    """A page's holder -> tiers, decoded from the index's mask (bit 3 * slot + rank)."""
    v = (idx._full if full else idx._swa).get(key, 0)
    return {h: {t for r, t in enumerate(("L1", "L2", "L3")) if v >> (3 * s + r) & 1}
            for h, s in idx._slots.items() if v >> (3 * s) & 7}


def _ref_overlap(idx: PrefixIndex, keys, worker, window_pages, shared_l3=True):
    """The rule of the module doc, page by page (the index's walk before it was made C-level): the oracle.
    ``shared_l3`` False: the worker's own pages alone (``own_overlap``)."""
    def top(holders):
        if not holders:
            return None
        mine = holders.get(worker) or ()
        if mine:
            return min(mine, key={"L1": 0, "L2": 1, "L3": 2}.__getitem__)
        return "L3" if shared_l3 and "L3" in holders.get(L3_WORKER, ()) else None
    best, at_best, seen, run_start = 0, {"L1": 0, "L2": 0, "L3": 0}, {"L1": 0, "L2": 0, "L3": 0}, None
    for i, k in enumerate(keys):
        t = top(_holders(idx, True, k))
        if t is None:
            break
        seen[t] += 1
        if not window_pages:
            best, at_best = i + 1, dict(seen)
        elif top(_holders(idx, False, k)) is not None:
            run_start = i if run_start is None else run_start
            if run_start == 0 or i + 1 - run_start >= window_pages:
                best, at_best = i + 1, dict(seen)
        else:
            run_start = None
    return best, at_best


@pytest.mark.parametrize("compiled", [True, False])
def test_overlap_matches_the_page_by_page_rule_on_random_indexes(compiled, monkeypatch):
    import random

    from actors import routing
    if not compiled:
        monkeypatch.setattr(routing, "_c_overlap", None)
    elif routing._c_overlap is None:
        pytest.skip("actors/_routing.c did not build here")
    rng = random.Random(7)
    workers = ["p0", "p1", "p2"]
    for trial in range(300):
        idx, n = PrefixIndex(), rng.randrange(1, 11)
        if trial % 3 == 0:   # holders that came and went first: the workers' bits lie past 64 (slot 21+)
            for d in range(rng.choice((5, 25))):
                idx.apply(f"gone{d}", [ev("stored", "L1", "full", KEYS[:1])])
                idx.drop_worker(f"gone{d}")
        for holder in workers + [L3_WORKER]:
            for comp in ("full", "swa"):
                for tier in (("L3",) if holder == L3_WORKER else ("L1", "L2")):
                    if rng.random() < 0.6:
                        idx.apply(holder, [ev("stored", tier, comp, rng.sample(KEYS[:n], rng.randrange(n + 1)))])
        if rng.random() < 0.3:    # removals leave holders without a tier, keys without holders
            idx.apply(rng.choice(workers), [ev("removed", "L1", rng.choice(("full", "swa")), KEYS[:n])])
        if rng.random() < 0.2:
            gone = rng.choice(workers)
            held = set(idx.blocks(gone)) | set(idx.blocks(gone, full=False))
            assert idx.drop_worker(gone) == len(held)
            assert not idx.blocks(gone) and not idx.blocks(gone, full=False)
        for w in (0, 1, 2, 3):
            got = idx.overlap_all(BLOCKS[:n], workers + ["never_seen"], w)
            for worker in workers + ["never_seen"]:
                pages, tiers = _ref_overlap(idx, BLOCKS[:n], worker, w)
                assert (got[worker].pages, got[worker].by_tier) == (pages, tiers), (trial, worker, w)
                own = idx.own_overlap(BLOCKS[:n], worker, w)
                assert (own.pages, own.by_tier) == _ref_overlap(idx, BLOCKS[:n], worker, w, False), (trial, worker, w)
            # route: the lowest cost (the first on a tie), from the same overlaps
            loads = {x: WorkerLoad(queued_tokens=rng.choice((0, 4, 8)), running=rng.randrange(2)) for x in workers}
            geom = KVGeometry(page_size=4, window=4 * w + 1) if w else KVGeometry(page_size=4)
            costs = []
            for x in workers:
                pages, tiers = _ref_overlap(idx, BLOCKS[:n], x, w)
                costs.append((CFG.miss_weight * (4 * n + 1 - pages * 4)
                              + 4 * (CFG.l1_weight * tiers["L1"] + CFG.l2_weight * tiers["L2"] + CFG.l3_weight * tiers["L3"])
                              + CFG.load_weight * loads[x].queued_tokens + CFG.running_weight * loads[x].running))
            pick, ov = route(idx, BLOCKS[:n], 4 * n + 1, loads, CFG, geom)
            assert pick == workers[costs.index(min(costs))]
            assert (ov.pages, ov.by_tier) == _ref_overlap(idx, BLOCKS[:n], pick, w)


def test_prompt_blocks_are_the_first_8_bytes_of_the_keys():
    import random
    rng = random.Random(3)
    for n in (0, 1, 4, 5, 41, 333):
        toks = [rng.randrange(1 << 40) for _ in range(n)]
        assert prompt_blocks(toks, GEOM, CFG) == [int.from_bytes(k[:8], "big") for k in prompt_keys(toks, GEOM, CFG)]
        assert prompt_blocks(tuple(toks), GEOM, CFG) == prompt_blocks(toks, GEOM, CFG)


def test_blocks_and_drop_worker_read_the_masks():
    idx = PrefixIndex()
    idx.apply("p0", [ev("stored", "L1", "full", KEYS[:4]), ev("stored", "L2", "full", KEYS[2:6]),
                     ev("stored", "L1", "swa", KEYS[6:8])])
    idx.apply("p1", [ev("stored", "L1", "full", KEYS[:2])])
    assert idx.blocks("p0") == set(BLOCKS[:6]) and idx.blocks("p0", "L2") == set(BLOCKS[2:6])
    assert idx.blocks("p0", "L1", full=False) == set(BLOCKS[6:8]) and idx.blocks("nobody") == set()
    idx.apply("p0", [ev("removed", "L1", "full", KEYS[:3]), ev("removed", "L2", "full", KEYS[:3])])
    assert idx.blocks("p0") == set(BLOCKS[3:6]) and len(idx) == 5
    assert idx.drop_worker("p0") == 5 and idx.drop_worker("p0") == 0 and idx.drop_worker("nobody") == 0
    assert len(idx) == 2 and idx.blocks("p1") == set(BLOCKS[:2]) and not idx._swa
    idx.apply("p0", [ev("stored", "L1", "full", KEYS[:1])])   # back: the same slot, no stale bits
    assert idx.blocks("p0") == {BLOCKS[0]} and idx.overlap(BLOCKS, "p0", 0).pages == 1
    with pytest.raises(ValueError, match="tier"):
        idx.apply("p0", [ev("stored", "L4", "full", KEYS[:1])])
