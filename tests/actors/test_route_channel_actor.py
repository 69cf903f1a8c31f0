"""The ingress's side of the route channel against a real router actor on a local Ray cluster
(actors/ingress.RayBackend without Serve or workers: one worker's reports are sent as a worker sends
them): routes go over the channel, not Ray; the router killed while routes flow fails none of them and
hangs none (those the channel loses go over Ray, which waits for the restart; the restart's warm-up
NoWorkerError is retried), and the next routes go over the restarted router's new channel."""
from __future__ import annotations

import asyncio

import pytest

from cluster import launch  # sets the Ray environment (loopback, no token auth) on import
from engine.model.loader import resolve_model_path

ray = pytest.importorskip("ray")

LOAD = {"free_pages": 100, "total_pages": 100}


@pytest.fixture(scope="module")
def setup():
    from actors.ingress import RayBackend
    from actors.router import PrefixRouterActor
    from actors.routing import RouterConfig
    from storage.geometry import KVGeometry
    launch.start_local_ray(num_cpus=2)
    router = PrefixRouterActor.options(num_cpus=0).remote(RouterConfig(), KVGeometry(16))
    ray.get(router.report.remote("c0", "colocated", LOAD, True), timeout=60)
    b = RayBackend(router, {}, "strata-tiny", str(resolve_model_path("strata-tiny")), 256, 8192,
                   request_timeout=60.0)
    yield b, router
    b.close_channels()
    ray.shutdown()


def _channel(router) -> dict:
    return ray.get(router.status.remote(), timeout=60)["route_channel"]


def test_routes_go_over_the_channel(setup):
    b, router = setup
    before = _channel(router)
    assert before["endpoint"].startswith("tcp://")

    async def main():
        return [await b._route([1, 2, 3], 48, ()) for _ in range(5)]
    got = asyncio.run(main())
    assert [r.prefill for r in got] == ["c0"] * 5 and all(r.decode is None for r in got)
    assert _channel(router)["answered"] == before["answered"] + 5


def test_a_router_killed_while_routes_flow_fails_none_and_its_new_channel_is_used(setup):
    b, router = setup
    old = _channel(router)["endpoint"]

    async def reports(stop: asyncio.Event):   # as a worker does, every 50 ms: a restarted router learns c0
        while not stop.is_set():
            try:
                await asyncio.wait_for(router.report.remote("c0", "colocated", LOAD, False), 5)
            except (ray.exceptions.RayError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.05)

    async def flow(n: int) -> list:
        out = []
        for _ in range(n):
            out.append(await asyncio.wait_for(b._route([4, 5], 32, ()), 30))   # never a hang
            await asyncio.sleep(0.01)
        return out

    async def main():
        stop = asyncio.Event()
        rep = asyncio.ensure_future(reports(stop))
        try:
            await flow(3)
            flows = [asyncio.ensure_future(flow(40)) for _ in range(4)]
            await asyncio.sleep(0.1)
            ray.kill(router, no_restart=False)
            got = [r for f in await asyncio.gather(*flows) for r in f]
            after = await flow(10)
            return got, after
        finally:
            stop.set()
            await rep
    got, after = asyncio.run(main())
    assert len(got) == 160 and {r.prefill for r in got + after} == {"c0"}
    now = _channel(router)
    assert now["endpoint"] != old and now["answered"] >= 10, now
