"""The ingress's side of the token channel against a real worker actor on a local Ray cluster
(actors/ingress.RayBackend without Serve or a router): each request sent over the channel (no Ray call),
its items back over it, equal to the engine's; closing the stream early aborts the request and frees the
engine; a worker that dies mid-stream fails the stream (WorkerFailed: the channel's connection dropped)
instead of hanging, and once it is back the next request reconnects to its new channel; bad input stays a
ValueError; the Ray path (WorkerActor.submit) still serves a driver."""
from __future__ import annotations

import asyncio
import time

import pytest

from cluster import launch  # sets the Ray environment (loopback, no token auth) on import
from engine import Engine, EngineConfig, SamplingParams
from engine.model.checkpoint import resolve_model_path

ray = pytest.importorskip("ray")
from actors.frontend import WorkerFailed  # noqa: E402
from tests.util import wait_restarted  # noqa: E402

SP = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=2)


@pytest.fixture(scope="module")
def backend():
    from actors.ingress import RayBackend
    from actors.worker import WorkerActor
    launch.start_local_ray(num_cpus=2)
    path = str(resolve_model_path("strata-tiny"))
    cfg = EngineConfig(model=path, page_size=16, num_pages=256, torch_threads=1)
    w = WorkerActor.options(num_cpus=0.5).remote("w0", "colocated", cfg, None)
    ray.get(w.start.remote(), timeout=180)
    b = RayBackend(None, {"w0": w}, "strata-tiny", path, 256, 8192, request_timeout=60.0)
    yield b, path
    b.close_channels()
    ray.shutdown()


async def _collect(gen):
    return [i async for i in gen]


def _load(b) -> dict:
    return ray.get(b.workers["w0"].load.remote(), timeout=30)


def test_items_over_the_channel_equal_the_engines(backend):
    b, path = backend
    prompts = [[5, 6, 7], list(range(40)), [9] * 20]
    want = Engine.from_pretrained(path, page_size=16, num_pages=256).generate(prompts, SP)

    async def main():   # concurrently: one step's message carries several requests' items
        return await asyncio.gather(*(_collect(b.generate("w0", p, SP)) for p in prompts))
    for items, w in zip(asyncio.run(main()), want):
        assert [t for i in items for t in i.token_ids] == w.token_ids
        assert [i.finished for i in items] == [False] * (len(items) - 1) + [True]
        last = items[-1]
        assert last.finish_reason == "length" and last.prompt_tokens == w.prompt_tokens
        assert [lp.token_id for i in items for lp in i.logprobs] == w.token_ids
        assert all(len(lp.top) == 2 for i in items for lp in i.logprobs)


def test_closing_the_stream_cancels_the_request_on_the_worker(backend):
    b, _ = backend

    async def main():
        gen = b.generate("w0", [1, 2, 3], SamplingParams(max_new_tokens=3000, ignore_eos=True))
        for _ in range(3):
            await gen.__anext__()
        assert _load(b).running == 1
        await gen.aclose()        # what a client that leaves does to its stream
    asyncio.run(main())
    deadline = time.monotonic() + 3.0
    while _load(b).running:
        assert time.monotonic() < deadline, "the worker still decodes the abandoned request"
        time.sleep(0.02)


def test_bad_input_is_a_value_error(backend):
    b, _ = backend
    with pytest.raises(ValueError, match="prompt"):
        asyncio.run(_collect(b.generate("w0", [1, 99999], SP)))


def test_a_worker_killed_mid_stream_fails_it_and_the_next_request_uses_its_new_channel(backend):
    b, _ = backend
    w = b.workers["w0"]
    before = ray.get(w.token_channel.remote())

    async def stream():
        gen = b.generate("w0", [4, 5, 6], SamplingParams(max_new_tokens=3000, ignore_eos=True))
        await gen.__anext__()
        ray.kill(w, no_restart=False)
        async for _ in gen:
            pass
    t = time.monotonic()
    with pytest.raises(WorkerFailed, match="dropped"):   # the channel's connection: no Ray call to fail
        asyncio.run(stream())
    assert time.monotonic() - t < 30
    wait_restarted(w)    # back: a new process, a new channel
    assert ray.get(w.token_channel.remote()) != before
    items = asyncio.run(_collect(b.generate("w0", [4, 5, 6], SamplingParams(max_new_tokens=4, ignore_eos=True))))
    assert sum(len(i.token_ids) for i in items) == 4 and items[-1].finished



def _cores_of(w) -> tuple[list[int] | None, set[tuple[int, ...]]]:
    """What the worker says its cores are, and the affinities its process's threads have."""
    import os
    cores = ray.get(w.start.remote(), timeout=60)["cores"]
    pid = ray.get(w.process_info.remote(), timeout=30)["pid"]
    tids = os.listdir(f"/proc/{pid}/task")
    assert len(tids) > 5   # Ray's threads, the engine's, the channel's: started before binding and after
    return cores, {tuple(sorted(os.sched_getaffinity(int(t)))) for t in tids}


def test_workers_on_a_machine_bind_to_cores_of_their_own_alone_or_two(backend):
    """CPU engines with torch_threads=1 (actors/cpu_binding.py): the worker alone (restarted by the kill
    above: its seat is its new process's) is bound to the highest core; a second one on this machine takes
    a core of its own, every thread of its process on it; the second gone, the first keeps its core."""
    import os
    from actors.cpu_binding import REFRESH_S, held_seats
    from actors.worker import WorkerActor
    usable = tuple(sorted(os.sched_getaffinity(0)))
    if len(usable) < 2:
        pytest.skip("one usable core: nothing to bind to")
    w0, path = backend[0].workers["w0"], backend[1]
    assert held_seats() == 1, "another worker holds a seat on this machine (a cluster beside the tests?)"
    hi, lo = [usable[-1]], [usable[-2]]
    assert _cores_of(w0) == (hi, {tuple(hi)})
    cfg = EngineConfig(model=path, page_size=16, num_pages=64, torch_threads=1)
    w1 = WorkerActor.options(num_cpus=0.5).remote("w1", "colocated", cfg, None)
    try:
        assert _cores_of(w1) == (lo, {tuple(lo)})   # seat 1: the next core down
        assert held_seats() == 2
        assert _cores_of(w0) == (hi, {tuple(hi)})
    finally:
        ray.kill(w1, no_restart=True)
    deadline = time.monotonic() + 20 * REFRESH_S
    while held_seats() != 1:
        assert time.monotonic() < deadline, "the second worker's seat outlived its process"
        time.sleep(REFRESH_S / 4)
    time.sleep(2 * REFRESH_S)   # a refresh alone again
    assert _cores_of(w0) == (hi, {tuple(hi)})
