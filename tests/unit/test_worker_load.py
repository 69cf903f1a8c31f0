"""A worker's load crosses to the router typed (engine/worker_load.py): what the engine reports, the report's
wire, the router's count of the requests it routes between two reports, and its status document."""
import asyncio

import pytest

from actors.prefix_router import Router
from actors.route_channel import ReportClient, RouteServer, RouterError
from actors.routing import RouterConfig, prompt_blocks
from engine import Engine, SamplingParams
from engine.async_engine import AsyncEngine
from engine.worker_load import WorkerLoad
from storage.config import HiCacheConfig
from storage.geometry import KVGeometry

GEOM = KVGeometry(page_size=16)


def test_the_engine_reports_its_batch_pages_and_tiers():
    for hicache in (None, HiCacheConfig(host_pages=64, write_policy="write_through")):
        core = AsyncEngine(Engine.from_pretrained("strata-tiny", page_size=16, num_pages=64, max_batch_tokens=128,
                                                  enable_prefix_cache=True,
                                                  hicache=hicache))
        try:
            idle = core.load()
            assert type(idle) is WorkerLoad
            assert idle[:5] == (0, 0, 0, 64, 64)

            async def main():
                return [i async for i in core.generate(list(range(1, 40)), SamplingParams(max_new_tokens=2))]
            asyncio.run(main())
            after = core.load()
            assert (after.running, after.waiting, after.total_pages) == (0, 0, 64)
            if hicache is None:
                assert after.host_kv_bytes is None and after.kv_moved_bytes is None
                assert "host_kv_bytes" not in after.as_document()
            else:
                # The prompt's two full pages were written through to L2.
                assert after.host_kv_bytes > 0 and after.kv_moved_bytes["L1->L2"] > 0
                assert set(after.kv_loadback_pages) >= {"loaded", "used", "wasted"}
                assert after.as_document()["host_kv_bytes"] == after.host_kv_bytes
        finally:
            core.close()


def test_the_router_counts_what_it_routes_until_the_next_report():
    r = Router(RouterConfig(local_prefill_tokens=0), GEOM)
    r.report("p0", "prefill", WorkerLoad(queued_tokens=5, free_pages=100, total_pages=100), True, now=0.0)
    r.report("d0", "decode", WorkerLoad(running=1, free_pages=50, total_pages=100), True, now=0.0)
    sent = r.loads["p0"]
    toks = list(range(100, 164))
    for i in range(3):
        assert r.route(prompt_blocks(toks, GEOM, r.cfg), len(toks), now=0.01 * i)[:2] == ("p0", "d0")
    assert r.loads["p0"] == WorkerLoad(queued_tokens=5 + 3 * 64, free_pages=100, total_pages=100)
    assert r.loads["d0"].running == 4 and r.loads["d0"].queued_tokens == 0
    assert sent.queued_tokens == 5    # the report itself is not changed: the router holds its own count
    r.report("p0", "prefill", WorkerLoad(free_pages=99, total_pages=100), False, now=0.05)
    assert r.loads["p0"].queued_tokens == 0
    doc = r.status(now=0.06)["workers"]
    assert doc["p0"]["load"] == {"queued_tokens": 0, "running": 0, "waiting": 0, "free_pages": 99, "total_pages": 100}
    assert doc["d0"]["load"]["running"] == 4


def test_a_load_that_is_not_a_worker_load_is_refused_naming_the_worker():
    r = Router(RouterConfig(), GEOM)
    with pytest.raises(ValueError, match="report of p0: load must be a WorkerLoad, not dict"):
        r.report("p0", "prefill", {"queued_tokens": 0}, True, now=0.0)
    assert "p0" not in r.loads and "p0" not in r.roles
    # Over the route channel the report does not decode: the worker hears why, the router holds nothing.
    got = []
    server = RouteServer("127.0.0.1", lambda *a: None, lambda *a: got.append(a))
    c = ReportClient(server.endpoint, timeout=5)
    try:
        with pytest.raises(RouterError, match=r"ValueError: bad report: Expected `array`, got `object`"):
            c.report("p0", "prefill", {"queued_tokens": 0}, True, None, None)
        with pytest.raises(RouterError, match=r"ValueError: bad report: Expected `int`, got `str`"):
            c.report("p0", "prefill", WorkerLoad(running="3"), True, None, None)
    finally:
        c.close()
        server.close()
    assert got == []
