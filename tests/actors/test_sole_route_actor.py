"""The ingress's sole route (actors/route_asker.py) against a real router and a real colocated worker on a
local Ray cluster (actors/ingress.RayBackend without Serve): while the router's last answer said the worker
was the only choice (``Route.alone``), a request is on the worker's token channel before the router is
asked, and the router is still asked for each (its count and load estimate), its prediction still the hit
the worker delivers; a second worker makes the router's answer no longer the only choice, and the requests
after it ask first again; a request sent to a worker the operator has just drained is withdrawn there and
served where the router says."""
from __future__ import annotations

import asyncio
import time

import pytest

from cluster import launch  # sets the Ray environment (loopback, no token auth) on import
from engine import EngineConfig, SamplingParams
from engine.model.checkpoint import resolve_model_path
from engine.worker_load import WorkerLoad

ray = pytest.importorskip("ray")

SP = SamplingParams(max_new_tokens=4, ignore_eos=True)
PROMPT = list(range(3, 3 + 80))   # 5 pages of 16: the later requests find 4 of them cached


@pytest.fixture(scope="module")
def setup():
    from actors.ingress import RayBackend
    from actors.router import PrefixRouterActor
    from actors.routing import RouterConfig
    from actors.worker import WorkerActor
    from storage.geometry import KVGeometry
    from storage.kv_events import KVEventsConfig
    launch.start_local_ray(num_cpus=2)
    path = str(resolve_model_path("strata-tiny"))
    router = PrefixRouterActor.options(num_cpus=0).remote(RouterConfig(), KVGeometry(16))
    w = WorkerActor.options(num_cpus=0.5).remote("w0", "colocated", EngineConfig(
        model=path, page_size=16, num_pages=256, torch_threads=1, enable_prefix_cache=True), router,
        kv_events=KVEventsConfig())
    ray.get(w.start.remote(), timeout=180)
    deadline = time.monotonic() + 60
    while "w0" not in ray.get(router.status.remote(), timeout=30)["workers"]:
        assert time.monotonic() < deadline, "the worker never reported"
        time.sleep(0.1)
    b = RayBackend(router, {"w0": w}, "strata-tiny", path, 256, 8192, request_timeout=60.0)
    yield b, router
    b.close_channels()
    ray.shutdown()


def _decisions(router) -> int:
    return ray.get(router.status.remote(), timeout=30)["decisions"]


async def _requests(b, n: int, asked: list[int]) -> list:
    """``n`` requests one after another: (Served, last item) each; ``asked`` gets, for each route asked
    over the channel, how many requests the worker's token channel had open at that moment."""
    out = []
    for _ in range(n):
        client = await b.routes.client()
        client.asked = asked
        if not hasattr(client, "ask"):
            client.ask = client.route

            async def route(*a, _c=client, **kw):
                _c.asked.append(len(b._channels["w0"]._queues) if "w0" in b._channels else 0)
                return await _c.ask(*a, **kw)
            client.route = route
        s = b.stream(PROMPT, SP)
        items = [i async for i in s]
        out.append((s.served, items[-1]))
        await asyncio.sleep(0.2)   # the worker's KV events reach the router within a report interval
    return out


def test_the_sole_workers_requests_go_out_before_their_route_and_keep_the_prediction(setup):
    b, router = setup
    before, asked = _decisions(router), []
    got = asyncio.run(_requests(b, 4, asked))
    # The first asks first (nothing learned yet); the others are on the worker's channel when asked.
    assert asked == [0, 1, 1, 1], asked
    assert _decisions(router) == before + 4       # the router still counts every request
    assert [s.prefill for s, _ in got] == ["w0"] * 4 and all(s.decode is None for s, _ in got)
    # The prediction is the hit, request by request, whether the route came before or beside the request.
    assert [s.predicted_cached_tokens for s, _ in got] == [last.cached_tokens for _, last in got], got
    assert got[-1][1].cached_tokens == 64 and all(last.finished for _, last in got)


def test_a_second_worker_makes_the_next_requests_ask_first(setup):
    b, router = setup
    load = WorkerLoad(free_pages=256, total_pages=256)

    async def main():   # one event loop throughout: the channels opened stay open
        await _requests(b, 1, [])                                # learns w0 as the only choice
        await router.report.remote("c1", "colocated", load, True)   # another worker reports
        try:
            asked: list[int] = []
            got = await _requests(b, 2, asked)
            # The first was sent to w0 already; the router's answer (two choices now) ends the shortcut,
            # so the second asks first. Both go to w0: the router knows w0 holds the prompt.
            assert asked == [1, 0], asked
            assert [s.prefill for s, _ in got] == ["w0", "w0"], got
            assert b.routes.sole(b.workers) is None
        finally:
            await router.remove_worker.remote("c1")
        asked = []
        await _requests(b, 2, asked)     # one worker again: learned from the next answer
        assert asked == [0, 1], asked
    asyncio.run(main())


def test_a_request_sent_to_a_drained_worker_is_withdrawn_and_served_where_the_router_says(setup):
    from actors.worker import WorkerActor
    from storage.kv_events import KVEventsConfig
    b, router = setup
    path = str(resolve_model_path("strata-tiny"))
    w1 = WorkerActor.options(num_cpus=0.5).remote("w1", "colocated", EngineConfig(
        model=path, page_size=16, num_pages=256, torch_threads=1, enable_prefix_cache=True), router,
        kv_events=KVEventsConfig())
    ray.get(w1.start.remote(), timeout=180)
    b.workers["w1"] = w1

    async def main():
        await router.drain.remote("w1")                        # w1 waits aside: w0 is the only choice
        await _requests(b, 1, [])
        assert b.routes.sole(b.workers).prefill == "w0"
        await router.restore_worker.remote("w1")
        await router.drain.remote("w0")                        # the operator drains w0 now
        deadline = time.monotonic() + 30
        while not (await router.status.remote())["workers"].get("w1", {}).get("live", False):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        asked: list[int] = []
        got = await _requests(b, 1, asked)
        assert asked == [1], asked                # sent to w0 before the router was asked
        served, last = got[0]
        assert served.prefill == "w1" and last.finished and last.error is None, got   # withdrawn, served by w1
        assert served.predicted_cached_tokens == last.cached_tokens
        assert b.routes.sole(b.workers).prefill == "w1"     # the only choice now
        deadline = time.monotonic() + 10
        while True:   # nothing left on w0 (an abort lands at its engine's next step)
            load = await b.workers["w0"].load.remote()
            if load.running == 0 and load.waiting == 0:
                break
            assert time.monotonic() < deadline, load
            await asyncio.sleep(0.05)
    try:
        asyncio.run(main())
    finally:
        ray.get(router.restore_worker.remote("w0"), timeout=30)
        ray.get(router.remove_worker.remote("w1"), timeout=30)
        b.workers.pop("w1", None)
        ray.kill(w1)


def test_a_request_that_comes_while_the_first_fetches_the_routers_config_waits_for_all_of_it(setup):
    """A fresh replica fetches the router's config and geometry at its first request; a second request
    that comes in between (it saw one set, the other not yet) once hashed its prompt with no geometry (a
    500 in CI's multiturn test, two requests at start). Both are set at once now."""
    from actors.ingress import RayBackend
    b, router = setup
    fresh = RayBackend(router, dict(b.workers), "strata-tiny", b.model_path, 256, 8192, request_timeout=60.0)

    async def one():
        return [i async for i in fresh.stream(PROMPT, SP)]

    async def main():
        first = asyncio.ensure_future(one())
        while fresh.router_cfg is None and not first.done():
            await asyncio.sleep(0)
        assert fresh.geometry is not None or first.done()   # never one without the other
        return await asyncio.gather(first, one())
    try:
        got = asyncio.run(main())
    finally:
        fresh.close_channels()
    assert [sum(len(i.token_ids) for i in items) for items in got] == [4, 4]


def test_the_worker_and_the_router_froze_their_startup_heap(setup):
    """actors/startup_heap.py: what the worker and the router allocated while starting (torch, Ray, the
    model, the engine) is out of the cyclic GC's walks, after serving too: a full collection walks only
    what came since (``gc.get_objects``: the tracked objects outside the frozen generation), a small part."""
    b, router = setup
    asyncio.run(_requests(b, 2, []))

    def heap(_actor):
        import gc
        gc.collect()
        return gc.get_freeze_count(), len(gc.get_objects())
    for name, h in (("worker", b.workers["w0"]), ("router", router)):
        frozen, walked = ray.get(h.__ray_call__.remote(heap), timeout=60)
        assert frozen > 50_000 and walked < frozen / 4, (name, frozen, walked)
