"""``python -m bench.overhead --hops``: each hop of the colocated path timed on its own from a Ray driver
beside the cluster, one request at a time (a bare actor call, the router's route over Ray and over its
route channel, the worker's stream alone, the token channel, and HTTP), beside the engine alone: the
differences name what each layer adds. Merged into bench/results/overhead.json as ``hops_<config>``."""
from __future__ import annotations

import os
import time

from bench.common import merge_json, table
from bench.overhead import LONG, REPS, Server, dist, engine_rows, prompts


def run_hops(name: str, n: int, switch_interval: float | None = None) -> int:
    """``hops`` (``n`` each) and the engine alone's rows beside them: printed, and written."""
    h = hops(n, name, switch_interval)
    eng = engine_rows({**REPS["quick"], "short": 1, "streams": 1})
    rows = [{"hop": k, "p50": v["p50"], "p90": v["p90"], "unit": "s" if "64" in k else "ms"} for k, v in h.items()]
    rows += [{"hop": "engine alone, 1 new (cached 512)", "p50": eng["ttft_cached"]["p50"],
              "p90": eng["ttft_cached"]["p90"], "unit": "ms"},
             {"hop": "engine alone, 64 new", "p50": eng["long64"]["p50"], "p90": eng["long64"]["p90"], "unit": "s"}]
    print(table(rows, ["hop", "p50", "p90", "unit"]))
    key = f"hops_{name}" + (f"_switch_{switch_interval:g}" if switch_interval else "")
    path = merge_json("overhead", key, {"load_avg_after": os.getloadavg(), "rows": rows})
    print(f"wrote {path}")
    return 0


def hops(n: int, name: str = "colocated", switch_interval: float | None = None) -> dict:
    """Round trips of each hop of the colocated path, timed from a Ray driver beside the cluster (sequential,
    ``n`` each): a bare actor call (worker.ping), the router's route (over Ray, and over its route channel
    as the ingress asks it), the worker's stream alone (first item of a cached 512-token prompt; 64
    tokens), and over HTTP /v1/models (proxy + replica + FastAPI, no backend), /generate of 1 and of 64
    tokens. The differences name what each layer adds."""
    import asyncio
    import httpx
    from cluster.launch import set_ray_env
    set_ray_env()
    import ray
    from actors.routing import prompt_blocks
    from engine.sampling import SamplingParams
    srv = Server(name, switch_interval=switch_interval)
    try:
        gcs = srv.ray_address()
        ray.init(address=gcs, namespace="strata", log_to_driver=False)
        worker = ray.get_actor("strata-colocated-0", namespace="strata")
        router = ray.get_actor(next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                                    if "router" in a["name"]), namespace="strata")
        long = prompts(1, LONG, 1)[0]
        geometry, rcfg = ray.get(router.geometry.remote()), ray.get(router.config.remote())
        keys = prompt_blocks(long, geometry, rcfg)
        sp = lambda k: SamplingParams(max_new_tokens=k, temperature=0.0, ignore_eos=True)  # noqa: E731

        async def run() -> dict:
            out: dict = {}

            async def timed(name, fn, k=n, scale=1000.0):
                for _ in range(3):
                    await fn()
                lat = []
                for _ in range(k):
                    t = time.perf_counter()
                    await fn()
                    lat.append(time.perf_counter() - t)
                out[name] = dist(lat, scale)

            from actors.token_channel import ChannelClient, request_items, settle
            import uuid
            import zmq.asyncio
            chan_ctx = zmq.asyncio.Context()
            chan = ChannelClient(chan_ctx, ray.get(worker.token_channel.remote()), uuid.uuid4().bytes)
            await chan.ready(10)

            async def channel(k):   # what the ingress does: one submit, the items over the token channel
                key, q = chan.open()
                asyncio.ensure_future(settle(worker.submit.remote(long, sp(k), chan.identity, key), q))
                items = 0
                async for item in request_items(q, 60, 10):
                    items += len(item.token_ids)
                chan.release(key)
                return items

            async def first(k):
                gen = worker.generate.remote(long, sp(k))
                items = 0
                async for ref in gen:
                    item = await ref
                    items += len(item.token_ids)
                    if k == 1 or item.finished:
                        break
                return items

            async with httpx.AsyncClient(timeout=60) as http:
                async def gen_http(k):
                    r = await http.post(f"{srv.url}/generate", json={
                        "input_ids": long, "sampling_params": {"max_new_tokens": k, "temperature": 0.0,
                                                               "ignore_eos": True}})
                    r.raise_for_status()
                await timed("worker.ping (bare actor call)", lambda: worker.ping.remote())
                await timed("router.route (512-token keys)", lambda: router.route.remote(keys, len(long), []))
                endpoint = await router.route_endpoint.remote() if hasattr(router, "route_endpoint") else None
                if endpoint is not None:   # what the ingress does (actors/route_channel.py)
                    from actors.route_channel import RouteClient
                    rc = RouteClient(chan_ctx, endpoint)
                    await timed("router.route over the route channel (ZMQ)", lambda: rc.route(keys, len(long), []))
                    rc.close()
                await timed("worker.generate stream, 1 new (cached 512)", lambda: first(1))
                await timed("worker.submit + token channel, 1 new (cached 512)", lambda: channel(1))
                await timed("HTTP GET /v1/models", lambda: http.get(f"{srv.url}/v1/models"))
                await timed("HTTP /generate, 1 new (cached 512)", lambda: gen_http(1))
                await timed("worker.generate stream, 64 new", lambda: first(64), max(3, n // 10), 1.0)
                await timed("worker.submit + token channel, 64 new", lambda: channel(64), max(3, n // 10), 1.0)
                await timed("HTTP /generate, 64 new", lambda: gen_http(64), max(3, n // 10), 1.0)
            return out
        return asyncio.run(run())
    finally:
        try:
            ray.shutdown()
        finally:
            srv.stop()
