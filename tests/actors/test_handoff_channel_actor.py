"""A P/D request over the token channels against a real prefill and a real decode worker on a local Ray
cluster (actors/ingress.RayBackend's ``handoff``, driven by KVHandoff, without Serve or a router): one
HANDOFF to the prefill worker, no Ray call from the ingress; the first token from the prefill worker's
channel, the rest from the decode worker's, equal to the engine's, the lease reserved and the decode half
handed on over the decode worker's channel (RESERVE, LEASED: no worker-to-worker Ray call); a client that leaves mid-decode stops
the decode worker's request (the ingress ABORTs it there) and no lease stays, also when that ABORT overtakes
the decode half the prefill worker sends (LEASED); a decode worker that
dies mid-stream fails the request as that worker's (WorkerFailed naming it), a prefill worker that dies
mid-decode does not, and bad input is a ValueError."""
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
from actors.handoff import KVHandoff  # noqa: E402

SP = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=2)


@pytest.fixture(scope="module")
def backend():
    from actors.ingress import RayBackend
    from actors.worker import WorkerActor, actor_name
    launch.start_local_ray(num_cpus=2)
    path = str(resolve_model_path("strata-tiny"))
    cfg = EngineConfig(model=path, page_size=16, num_pages=256, torch_threads=1)
    workers = {w: WorkerActor.options(name=actor_name(w), num_cpus=0.5).remote(w, role, cfg, None)
               for w, role in (("p0", "prefill"), ("d0", "decode"))}
    ray.get([h.start.remote() for h in workers.values()], timeout=180)
    b = RayBackend(None, workers, "strata-tiny", path, 256, 8192, request_timeout=60.0)
    yield b, path
    b.close_channels()
    ray.shutdown()


async def _collect(gen):
    return [i async for i in gen]


def _lease_stats(b):
    return ray.get(b.workers["d0"].transfer_stats.remote(), timeout=30).leases


def _leases(b) -> int:
    return _lease_stats(b).live


def _back_and_serving(b, handle) -> None:
    """``handle``'s worker, restarted (a new process, a new channel), serves the next handoff."""
    wait_restarted(handle)
    _wait_idle(b, 10.0)
    items = asyncio.run(_collect(KVHandoff(b).run([4, 5, 6], SamplingParams(max_new_tokens=4, ignore_eos=True),
                                                  "p0", "d0")))
    assert sum(len(i.token_ids) for i in items) == 4 and items[-1].finished


def _wait_idle(b, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while ray.get(b.workers["d0"].load.remote(), timeout=30).running or _leases(b):
        assert time.monotonic() < deadline, "the decode worker still holds the abandoned request or its lease"
        time.sleep(0.02)


@pytest.mark.numerics
def test_a_handed_off_request_equals_the_engine(backend):
    b, path = backend
    prompts = [[5, 6, 7], list(range(40)), [9] * 20]
    want = Engine.from_pretrained(path, page_size=16, num_pages=256).generate(prompts, SP)
    before = _lease_stats(b)
    received = _received(b)

    async def main():   # concurrently, and each both ways: streamed and whole
        runs = [_collect(KVHandoff(b).run(p, SP, "p0", "d0", whole)) for p in prompts for whole in (False, True)]
        return await asyncio.gather(*runs)
    got = asyncio.run(main())
    for n, items in enumerate(got):
        w = want[n // 2]
        assert [t for i in items for t in i.token_ids] == w.token_ids
        assert [i.finished for i in items] == [False] * (len(items) - 1) + [True]
        assert items[-1].finish_reason == "length" and items[-1].prompt_tokens == w.prompt_tokens
        assert [lp.token_id for i in items for lp in i.logprobs] == w.token_ids
    assert len(got[0]) == 12 and len(got[1]) == 2   # streamed: one item per step; whole: the first, then merged
    _wait_idle(b)
    after = _lease_stats(b)   # each request leased its pages once and committed them: none cancelled
    assert (after.reserved - before.reserved, after.committed - before.committed) == (6, 6)
    assert after.cancelled == before.cancelled
    # Each lease was reserved, and each decode half handed on, over the decode worker's channel (RESERVE and
    # LEASED on its request endpoint): no Ray call from worker to worker.
    assert _received(b) - received == 12


def _received(b) -> int:
    """Requests the decode worker's channel has taken in (RESERVE, LEASED, SUBMIT, HANDOFF)."""
    return ray.get(b.workers["d0"].__ray_call__.remote(lambda w: w.channel.received_requests), timeout=30)


def test_a_client_that_leaves_mid_decode_stops_it_on_the_decode_worker(backend):
    b, _ = backend

    async def main():
        gen = KVHandoff(b).run([1, 2, 3], SamplingParams(max_new_tokens=3000, ignore_eos=True), "p0", "d0")
        for _ in range(4):
            await gen.__anext__()
        assert ray.get(b.workers["d0"].load.remote(), timeout=30).running == 1
        await gen.aclose()        # what a client that leaves does to its stream
    asyncio.run(main())
    _wait_idle(b)


def test_bad_input_is_a_value_error_and_leaves_no_lease(backend):
    b, _ = backend
    with pytest.raises(ValueError, match="prompt"):
        asyncio.run(_collect(KVHandoff(b).run([1, 99999], SP, "p0", "d0")))
    _wait_idle(b)


def test_a_decode_worker_killed_mid_stream_fails_it_as_that_workers_failure(backend):
    b, _ = backend
    d = b.workers["d0"]

    async def stream():
        gen = KVHandoff(b).run([4, 5, 6], SamplingParams(max_new_tokens=3000, ignore_eos=True), "p0", "d0")
        for _ in range(3):
            await gen.__anext__()
        ray.kill(d, no_restart=False)
        async for _ in gen:
            pass
    t = time.monotonic()
    with pytest.raises(WorkerFailed) as e:
        asyncio.run(stream())
    assert e.value.workers == ("d0",) and time.monotonic() - t < 30
    _back_and_serving(b, d)
    # The prefill worker reserved on the restarted decode worker over a new channel to it, and closed the
    # one to the old process (whose connection dropped).
    assert ray.get(b.workers["p0"].__ray_call__.remote(
        lambda w: [(via, t.result().closed) for via, t in w._decode_channels.items()]), timeout=30) == \
        [(tuple(ray.get(d.channel_endpoints.remote(), timeout=30)), False)]


def test_a_prefill_worker_killed_mid_decode_does_not_stop_the_decode_half(backend):
    """After the first token the decode half is the decode worker's: the prefill worker (the caller of its
    Ray call, whose channel drops) dying then neither fails nor holds up the request."""
    b, path = backend
    p = b.workers["p0"]
    sp = SamplingParams(max_new_tokens=400, ignore_eos=True)
    want = Engine.from_pretrained(path, page_size=16, num_pages=256).generate([[7, 8, 9]], sp)[0].token_ids
    got: list[int] = []

    async def stream():
        gen = KVHandoff(b).run([7, 8, 9], sp, "p0", "d0")
        for _ in range(3):
            got.extend((await gen.__anext__()).token_ids)
        ray.kill(p, no_restart=False)
        async for item in gen:
            got.extend(item.token_ids)
    t = time.monotonic()
    asyncio.run(stream())   # Ray does not cancel a running actor task whose caller died: it goes on
    assert time.monotonic() - t < 30 and got == want
    _back_and_serving(b, p)


def test_an_abort_that_overtakes_its_decode_half_refuses_it_and_frees_its_lease(backend):
    """The ingress ABORTs both halves of a request whose client left; the decode half (LEASED, from the
    prefill worker) and that ABORT reach the decode worker from two senders, so the ABORT may come first:
    the decode half is then refused when it comes (nothing runs, nothing is sent) and its lease freed."""
    from actors.token_channel import Leased, LeasedSender
    b, _ = backend
    d = b.workers["d0"]
    ray.get(d.reserve.remote(3, "p0", lease_id="d0/overtaken-1"), timeout=30)
    assert _leases(b) == 1
    sender = LeasedSender()

    async def main():
        client = await b._channel("d0")
        key, q = client.open()
        client.abort(key)
        await asyncio.sleep(0.5)   # the ABORT first
        sender.send(client.requests_endpoint, client.identity, key,
                    Leased([1, 2, 3], "d0/overtaken-1", None, SamplingParams(max_new_tokens=4), False))
        await asyncio.sleep(1.0)
        client.release(key)
        return q.qsize()
    try:
        assert asyncio.run(main()) == 0   # refused silently: its client is gone
    finally:
        sender.close()
    _wait_idle(b)
