"""The route channel (actors/route_channel.py) without Ray: a real RouteServer thread in front of a plain
Router, RouteClients on an asyncio loop. Answers equal the Router's own (load counted once per answer),
errors come back by kind (NoWorkerError retried by the ingress, the rest a RouterError naming the
router), concurrent requests get their own answers, and a channel that cannot answer (the server gone,
an endpoint nobody listens on, a route that takes too long) says ChannelDown, promptly where the
connection is seen to be lost, so the ingress asks over Ray instead of hanging. A worker's reports
(ReportClient) reach the router's ``report`` whole (stream positions typed) and its answer comes back; a
router gone or silent is ChannelDown, so the worker reports over Ray instead."""
from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import threading
import time

import pytest
import zmq
import zmq.asyncio

from actors.prefix_router import ReportReply, Route, Router
from actors.route_channel import (ChannelDown, ReportClient, RouteClient, RouteServer, RouterError, answer,
                                  decode_reply, encode_request)
from actors.routing import NoWorkerError, RouterConfig
from engine.worker_load import WorkerLoad
from storage.geometry import KVGeometry
from storage.kv_events.publisher import KVEventsEndpoint, StreamPosition
from storage.kv_events.subscriber import Delivered
from storage.kv_events.wire import GPU, BlockStored, EventBatch
from tests.util import free_port

HOST = "127.0.0.1"


def _router(roles: dict[str, str]) -> Router:
    # The index alone (no recent routes): each answer here follows from the events the test applied.
    r = Router(RouterConfig(recent_reports=0), KVGeometry(16))
    for w, role in roles.items():
        r.report(w, role, WorkerLoad(free_pages=100), True, now=time.monotonic())
    return r


def _serving(router: Router):
    """The actor's locked ``route`` in miniature: the clock read, the core under a lock."""
    lock = threading.Lock()

    def route(keys, prompt_len, avoid, local):
        with lock:
            return router.route(keys, prompt_len, time.monotonic(), avoid, local)
    return route


@pytest.fixture
def cluster():
    router = _router({"c0": "colocated", "c1": "colocated"})
    # c1 holds the first 4 pages of prompt [1..8]: prefix routing sends that prompt there.
    router.apply([Delivered("c1", 0, EventBatch(0.0, [BlockStored([1, 2, 3, 4], None, [], 16, medium=GPU)]))])
    server = RouteServer(HOST, _serving(router))
    yield router, server
    server.close()


def test_answers_equal_the_routers_and_count_load_once(cluster):
    router, server = cluster

    async def main():
        c = RouteClient(zmq.asyncio.Context.instance(), server.endpoint, timeout=5)
        try:
            hit = await c.route(list(range(1, 9)), 128, None)
            avoided = await c.route(list(range(1, 9)), 128, ["c1"])
            return hit, avoided
        finally:
            c.close()
    hit, avoided = asyncio.run(main())
    assert hit == Route("c1", None, 4, {"L1": 4, "L2": 0, "L3": 0}) and isinstance(hit, Route)
    assert avoided.prefill == "c0" and avoided.cached_pages == 0
    assert router.decisions == 2 and server.answered == 2
    assert router.loads["c1"].queued_tokens == 128 and router.loads["c0"].queued_tokens == 128


def test_concurrent_requests_each_get_their_own_answer(cluster):
    router, server = cluster

    async def main():
        c = RouteClient(zmq.asyncio.Context.instance(), server.endpoint, timeout=5)
        try:
            return await asyncio.gather(*(c.route([1, 2, 3, 4] if i % 2 else [50 + i], 16, ["c1"] if i % 3 == 0
                                                  else None) for i in range(60)))
        finally:
            c.close()
    got = asyncio.run(main())
    for i, r in enumerate(got):
        if i % 3 == 0:
            assert r.prefill == "c0"
        assert r.cached_pages == (4 if i % 2 and r.prefill == "c1" else 0)
    assert router.decisions == 60


def test_no_worker_comes_back_as_itself_and_other_errors_name_the_router():
    router = Router(RouterConfig(), KVGeometry(16), ready_at=time.monotonic() + 60)   # a restart's warm-up
    router.report("c0", "colocated", WorkerLoad(), True, now=time.monotonic())
    calls = []

    def route(keys, prompt_len, avoid, local):
        calls.append(prompt_len)
        if prompt_len < 0:
            raise KeyError("bad")
        return router.route(keys, prompt_len, time.monotonic(), avoid)
    server = RouteServer(HOST, route)

    async def main():
        c = RouteClient(zmq.asyncio.Context.instance(), server.endpoint, timeout=5)
        try:
            with pytest.raises(NoWorkerError, match="restarted"):
                await c.route([1], 16, None)
            with pytest.raises(RouterError, match=rf"router at {server.endpoint}: KeyError"):
                await c.route([1], -1, None)
            assert not c.closed   # an error is an answer: the channel stays
        finally:
            c.close()
    try:
        asyncio.run(main())
    finally:
        server.close()
    assert calls == [16, -1]


def test_a_request_that_does_not_decode_is_answered_as_a_value_error():
    rid, err = decode_reply(answer(lambda *a: None, b"\x93\x07\xa1x\x01"), "r")   # [7, "x", 1]
    assert rid == 7 and isinstance(err, RouterError) and "ValueError" in str(err)
    rid, r = decode_reply(answer(lambda k, n, a, loc: Route("p", "d", len(k), {"L1": n}),
                                 encode_request(3, [1, 2], 9, [])), "r")
    assert rid == 3 and r == Route("p", "d", 2, {"L1": 9})


def _serve_slowly(endpoint_out) -> None:
    """A router process whose routes and reports take 60 s (killed by the test before any answers)."""
    router = _router({"c0": "colocated"})
    server = RouteServer(HOST, lambda keys, n, avoid, local: (time.sleep(60),
                                                              router.route(keys, n, time.monotonic(), avoid))[1],
                         lambda *a: (time.sleep(60), ReportReply())[1])
    endpoint_out.put(server.endpoint)
    time.sleep(120)


@contextlib.contextmanager
def _slow_router_process():
    """(the process, its endpoint) of ``_serve_slowly`` in a spawned process, killed at the end."""
    mp = multiprocessing.get_context("spawn")
    q = mp.Queue()
    proc = mp.Process(target=_serve_slowly, args=(q,), daemon=True)
    proc.start()
    try:
        yield proc, q.get(timeout=60)
    finally:
        proc.kill()
        proc.join(10)


def test_a_router_process_that_dies_fails_its_pending_requests_at_once():
    with _slow_router_process() as (proc, endpoint):
        async def main():
            c = RouteClient(zmq.asyncio.Context.instance(), endpoint, timeout=30)
            try:
                pending = asyncio.ensure_future(c.route([1], 1, None))
                await asyncio.sleep(0.3)
                assert not pending.done()
                t = time.monotonic()
                os.kill(proc.pid, signal.SIGKILL)   # as ray.kill does: the socket closes with the process
                with pytest.raises(ChannelDown, match="lost"):
                    await pending
                assert time.monotonic() - t < 5 and c.closed   # not the 30 s timeout
                with pytest.raises(ChannelDown, match="closed"):
                    await c.route([1], 1, None)
            finally:
                c.close()
        asyncio.run(main())


def test_an_endpoint_nobody_listens_on_fails_fast_and_a_silent_one_times_out():
    async def main():
        ctx = zmq.asyncio.Context.instance()
        c = RouteClient(ctx, f"tcp://{HOST}:{free_port()}", timeout=10)
        t = time.monotonic()
        with pytest.raises(ChannelDown):
            await c.route([1], 1, None)
        assert time.monotonic() - t < 5 and c.closed
        # A peer that takes the connection and never answers (a hung router): the timeout.
        silent = zmq.Context.instance().socket(zmq.ROUTER)
        silent.setsockopt(zmq.LINGER, 0)
        port = silent.bind_to_random_port(f"tcp://{HOST}")
        c = RouteClient(ctx, f"tcp://{HOST}:{port}", timeout=0.3)
        try:
            with pytest.raises(ChannelDown, match="no answer in 0.3s"):
                await c.route([1], 1, None)
            assert not c.closed   # a slow answer is not a lost connection: the caller decides
        finally:
            c.close()
            silent.close()
    asyncio.run(main())


def test_reports_reach_the_routers_report_whole_and_its_answer_comes_back():
    got = []

    def report(worker, role, load, fresh, stream, l3):
        got.append((worker, role, load, fresh, stream, l3))
        if worker == "bad":
            raise KeyError("nope")
        return ReportReply(ignored=worker == "gone", resync=fresh)
    server = RouteServer(HOST, lambda *a: None, report)
    c = ReportClient(server.endpoint, timeout=5)
    pos = StreamPosition(KVEventsEndpoint("kv@c0", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:6557"), 41)
    l3 = StreamPosition(KVEventsEndpoint("kv@L3", "tcp://10.0.0.2:5557", "tcp://10.0.0.2:6557"), -1)
    load = WorkerLoad(running=3, free_pages=90, kv_moved_bytes={"L1->L2": 8192, "L2->L1": 0})
    try:
        assert c.report("c0", "colocated", load, True, pos, l3) == ReportReply(ignored=False, resync=True)
        assert c.report("gone", "prefill", WorkerLoad(), False, None, None) == ReportReply(ignored=True, resync=False)
        with pytest.raises(RouterError, match=rf"router at {server.endpoint}: KeyError"):
            c.report("bad", "decode", WorkerLoad(), False, None, None)
        assert not c.closed   # an error is an answer: the channel stays
    finally:
        c.close()
        server.close()
    assert got[0] == ("c0", "colocated", load, True, pos, l3)
    assert type(got[0][4]) is StreamPosition and type(got[0][4].endpoint) is KVEventsEndpoint
    assert [g[0] for g in got] == ["c0", "gone", "bad"] and server.reports == 3 and server.answered == 0
    plain = RouteServer(HOST, lambda *a: None)   # a channel made without ``report``: an error, not a hang
    c = ReportClient(plain.endpoint, timeout=5)
    try:
        with pytest.raises(RouterError, match="takes no reports"):
            c.report("c0", "colocated", WorkerLoad(), False, None, None)
    finally:
        c.close()
        plain.close()


def test_a_report_to_a_router_gone_or_silent_is_channel_down_and_closes_the_client():
    with _slow_router_process() as (proc, endpoint):
        c = ReportClient(endpoint, timeout=30)
        threading.Timer(0.5, os.kill, (proc.pid, signal.SIGKILL)).start()   # while its report waits
        t = time.monotonic()
        with pytest.raises(ChannelDown, match="lost"):
            c.report("c0", "colocated", WorkerLoad(), False, None, None)
        assert time.monotonic() - t < 10 and c.closed   # not the 30 s timeout
        with pytest.raises(ChannelDown, match="closed"):
            c.report("c0", "colocated", WorkerLoad(), False, None, None)
    silent = zmq.Context.instance().socket(zmq.ROUTER)   # takes the connection, never answers (hung)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port(f"tcp://{HOST}")
    c = ReportClient(f"tcp://{HOST}:{port}", timeout=0.3)
    try:
        with pytest.raises(ChannelDown, match="no answer to a report in 0.3s"):
            c.report("c0", "colocated", WorkerLoad(), False, None, None)
        assert c.closed
    finally:
        c.close()
        silent.close()


def test_a_route_says_when_it_was_the_only_choice_and_the_wire_carries_it():
    """``Route.alone``: one live worker of each role the route names, none avoided (the ingress then sends
    the next requests before asking: actors/ingress.py ``_sole_choice``)."""
    def alone(roles: dict[str, str], avoid=None, drop=()) -> bool:
        r = _router(roles)
        for w in drop:
            r.drain(w)
        return r.route([1, 2], 32, time.monotonic(), avoid).alone
    assert alone({"c0": "colocated"}) and alone({"p0": "prefill", "d0": "decode"})
    assert not alone({"c0": "colocated", "c1": "colocated"})
    assert not alone({"p0": "prefill", "p1": "prefill", "d0": "decode"})
    assert not alone({"p0": "prefill", "d0": "decode", "d1": "decode"})
    assert alone({"p0": "prefill", "d0": "decode", "d1": "decode"}, drop=["d1"])   # drained: not a choice
    assert not alone({"c0": "colocated"}, avoid=["c0"])    # it just failed this request: ask again next time
    r = _router({"c0": "colocated"})
    rid, got = decode_reply(answer(_serving(r), encode_request(5, [1, 2], 32, None)), "r")
    assert rid == 5 and got == Route("c0", None, 0, {"L1": 0, "L2": 0, "L3": 0}, True) and got.alone
