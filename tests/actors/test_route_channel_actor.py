"""The ingress's side of the route channel against a real router actor on a local Ray cluster
(actors/ingress.RayBackend without Serve or workers: one worker's reports are sent as a worker sends
them): routes go over the channel, not Ray; the router killed while routes flow fails none of them and
hangs none (those the channel loses go over Ray, which waits for the restart; the restart's warm-up
NoWorkerError is retried), and the next routes go over the restarted router's new channel. A real
worker's reports go over the channel too (every 50 ms, no Ray call), and after the router's restart over
its new one."""
from __future__ import annotations

import asyncio
import time

import pytest

from cluster import launch  # sets the Ray environment (loopback, no token auth) on import
from engine.model.checkpoint import resolve_model_path
from engine.worker_load import WorkerLoad

ray = pytest.importorskip("ray")

LOAD = WorkerLoad(free_pages=100, total_pages=100)


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
        return [await b.routes.route([1, 2, 3], 48, ()) for _ in range(5)]
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
            out.append(await asyncio.wait_for(b.routes.route([4, 5], 32, ()), 30))   # never a hang
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


def _until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return got


def test_a_workers_reports_go_over_the_channel_and_follow_a_restarted_router(setup):
    from actors.router import PrefixRouterActor
    from actors.routing import RouterConfig
    from actors.worker import WorkerActor, actor_name
    from engine import EngineConfig
    from storage.geometry import KVGeometry
    router = PrefixRouterActor.options(name="strata-router-reports", num_cpus=0).remote(RouterConfig(), KVGeometry(16))
    cfg = EngineConfig(model=str(resolve_model_path("strata-tiny")), page_size=16, num_pages=128, torch_threads=1)
    w = WorkerActor.options(name=actor_name("r0"), num_cpus=0.25).remote("r0", "colocated", cfg, "strata-router-reports")
    try:
        ray.get(w.start.remote(), timeout=180)
        _until(lambda: _channel(router)["reports"] >= 5, 30, "no report came over the channel")
        assert ray.get(router.route.remote([1, 2], 32), timeout=30).prefill == "r0"
        n, t = _channel(router)["reports"], time.monotonic()
        time.sleep(1.0)
        # Every report (one per 50 ms) came over the channel: over Ray this count would stay put.
        assert (_channel(router)["reports"] - n) / (time.monotonic() - t) >= 8
        old = _channel(router)["endpoint"]
        ray.kill(router, no_restart=False)
        # (ray.kill is asynchronous: until the old process is gone it may still answer with its endpoint)
        _until(lambda: (c := _try_channel(router)) is not None and c["endpoint"] != old, 60,
               "the restarted router never answered on a new channel")
        _until(lambda: _channel(router)["reports"] >= 5, 30, "the worker's reports never reached the new channel")
        assert _until(lambda: _try_route(router), 30, "the restarted router never routed to r0").prefill == "r0"
    finally:
        ray.kill(w, no_restart=True)
        ray.kill(router, no_restart=True)


def _try_channel(router) -> dict | None:
    try:
        return _channel(router)
    except ray.exceptions.RayError:
        return None


def _try_route(router):
    from actors.routing import NoWorkerError
    try:
        return ray.get(router.route.remote([1, 2], 32), timeout=30)
    except (NoWorkerError, ray.exceptions.RayTaskError):   # the restart's warm-up
        return None
