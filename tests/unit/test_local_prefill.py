"""Conditional disaggregation (pure: no Ray): a P/D request whose decode worker holds nearly all of its
prompt itself is prefilled there, with no handoff (actors/routing.local_prefill, Router.route)."""
import pytest

from actors.prefix_router import Router
from actors.routing import L3_WORKER, PrefixIndex, RouterConfig, local_prefill, prompt_blocks, prompt_keys
from engine.worker_load import WorkerLoad
from storage.geometry import KVGeometry
from storage.radix.node import KVEvent

GEOM = KVGeometry(page_size=4, window=8)   # window_pages 2
CFG = RouterConfig(local_prefill_tokens=8)
TOKS = list(range(41))                      # 10 cacheable pages, the last token always computed
KEYS = prompt_keys(TOKS, GEOM, CFG)
BLOCKS = prompt_blocks(TOKS, GEOM, CFG)


def held(index: PrefixIndex, worker: str, pages: int, tier: str = "L1") -> None:
    index.apply(worker, [KVEvent("stored", tier, "full", tuple(KEYS[:pages])),
                         KVEvent("stored", tier, "swa", tuple(KEYS[max(pages - 2, 0):pages]))])


@pytest.mark.parametrize("pages, tier, local", [
    (10, "L1", True),    # 1 token to compute
    (9, "L2", True),     # 5 tokens, its host tier counts as its own
    (8, "L1", False),    # 9 tokens: more than 8
    (0, "L1", False),    # a prompt new to it goes to a prefill worker, however short
])
def test_the_decode_worker_prefills_what_it_nearly_holds(pages, tier, local):
    idx = PrefixIndex()
    if pages:
        held(idx, "d0", pages, tier)
    got = local_prefill(idx, BLOCKS, len(TOKS), "d0", CFG, GEOM)
    assert (got is not None) == local
    if local:
        assert got.pages == pages and got.by_tier[tier] == pages


def test_what_only_the_shared_l3_holds_is_work_on_the_decode_side():
    idx = PrefixIndex()
    held(idx, L3_WORKER, 10, "L3")
    assert local_prefill(idx, BLOCKS, len(TOKS), "d0", CFG, GEOM) is None
    held(idx, "d0", 9)                          # its own 9 pages, the 10th only in L3: 5 tokens to do
    assert local_prefill(idx, BLOCKS, len(TOKS), "d0", CFG, GEOM).pages == 9
    # its full pages, but the window of sliding pages before the cut only in L3 (a decode worker keeps
    # the last window of what it decoded; the prefill worker wrote its checkpoints through to L3)
    idx2 = PrefixIndex()
    idx2.apply("d0", [KVEvent("stored", "L1", "full", tuple(KEYS))])
    idx2.apply(L3_WORKER, [KVEvent("stored", "L3", "swa", tuple(KEYS[8:10]))])
    assert idx2.overlap(BLOCKS, "d0", GEOM.window_pages).pages == 10
    assert local_prefill(idx2, BLOCKS, len(TOKS), "d0", CFG, GEOM) is None


def test_off_and_recent_routes_and_validation():
    idx = PrefixIndex()
    held(idx, "d0", 10)
    assert local_prefill(idx, BLOCKS, len(TOKS), "d0", RouterConfig(local_prefill_tokens=0), GEOM) is None
    # a prompt just routed to it counts as held before its events come
    assert local_prefill(PrefixIndex(), BLOCKS, len(TOKS), "d0", CFG, GEOM, recent_pages=10).pages == 10
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="local_prefill_tokens"):
            RouterConfig(local_prefill_tokens=bad)


def _router(cfg: RouterConfig = CFG) -> Router:
    r = Router(cfg, GEOM)
    r.report("p0", "prefill", WorkerLoad(queued_tokens=0, running=0), True, now=0.0)
    r.report("d0", "decode", WorkerLoad(free_pages=100, running=0), True, now=0.0)
    return r


def test_the_router_names_the_decode_worker_alone_and_never_as_the_sole_choice():
    r = _router()
    first = r.route(BLOCKS, len(TOKS), now=0.1)
    assert (first.prefill, first.decode, first.alone) == ("p0", "d0", True)   # new to d0: handed off
    held(r.index, "d0", 10)                    # d0 ran it, and inserted it in its tree
    again = r.route(BLOCKS, len(TOKS), now=0.2)
    assert (again.prefill, again.decode, again.cached_pages, again.alone) == ("d0", None, 10, False)
    assert r.status(0.2)["local_prefills"] == 1
    assert r.loads["d0"].running == 2 and r.loads["d0"].queued_tokens == len(TOKS)
    # a request with no decode phase (or one sent to the sole pair already) stays on the prefill worker
    stay = r.route(BLOCKS, len(TOKS), now=0.3, local=False)
    assert (stay.prefill, stay.decode, stay.alone) == ("p0", "d0", True)
    # the prompt just routed to d0 counts as its own until d0's events can have come (recent routes)
    r2 = _router()
    r2.recent.add("d0", BLOCKS)
    assert r2.route(BLOCKS, len(TOKS), now=0.1).prefill == "d0"


def test_round_robin_never_prefills_on_the_decode_worker():
    r = _router(RouterConfig(policy="round_robin", local_prefill_tokens=8))
    held(r.index, "d0", 10)
    assert r.route(BLOCKS, len(TOKS), now=0.1).decode == "d0"


def test_an_answer_prefilling_on_the_sole_pairs_decode_worker_keeps_the_pair():
    import asyncio

    from actors.prefix_router import Route
    from actors.route_asker import RouteAsker
    from actors.served import Served

    async def main():
        a = RouteAsker(None, lambda: None)
        a._learn(Route("p0", "d0", 0, {}, alone=True))
        a._learn(Route("d0", None, 10, {}, alone=False))     # a local prefill: says nothing of the pair
        kept = a.sole({"p0": 1, "d0": 1})
        a._learn(Route("p1", "d0", 0, {}, alone=False))      # another choice opened: asked first again
        return kept, a.sole({"p0": 1, "d0": 1})
    kept, after = asyncio.run(main())
    assert kept == Served("p0", "d0") and after is None
