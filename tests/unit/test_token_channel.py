"""The token channel in isolation (actors/token_channel.py, no Ray): the wire encoding round-trips every
StreamItem field, a step's items leave as one message per client, in order, items of a closed request are
dropped, a client that never said hello is stale, the race between a call's return and its last item,
and the AsyncEngine's per-step hook that feeds the channel."""
import asyncio
import math
import threading
import time
import uuid

import pytest
import torch
import zmq.asyncio

from actors.token_channel import (RETURNED, ChannelClient, ChannelLost, ChannelServer, Route, StaleChannel,
                                  decode_items, encode_items, request_items, settle)
from engine import Engine, SamplingParams
from engine import async_engine
from engine.async_engine import WHOLE_SEND_TOKENS, AsyncEngine
from engine.stream import StreamItem, merge_items
from engine.sampling import TokenLogprob

ITEMS = [
    StreamItem("r-0", [5]),
    StreamItem("r-1", [1, 2], True, "stop", 5, 3, {"L1": 2, "L2": 1, "L3": 0}, None,
               [TokenLogprob(1, -0.5, ((1, -0.5), (7, -1.25)), 1), TokenLogprob(2, -math.inf)],
               [None, TokenLogprob(3, -2.0, (), 4), TokenLogprob(9, -0.1, ((9, -0.1),), None)], "</s>"),
    StreamItem("r-2", [], True, "stop", 1, 0, {}, None, [], [], 42),               # stopped by a token id
    StreamItem("r-3", [], True, "error", error="engine step failed: boom"),
    StreamItem("r-4", [3, 4, 5], False, None, 0, 0, {}, None, [TokenLogprob(3, -1e-9, (), 2)] * 3, None, None),
    StreamItem("r-5", [6, 7], True, "length", 4, 0, held_s=0.125),                 # a whole request's merged item
]


def test_every_stream_item_field_round_trips_exactly():
    kind, payload = encode_items([(k, it) for k, it in enumerate(ITEMS)])
    assert kind == b"I"
    back = decode_items(kind, payload)
    assert [k for k, _ in back] == list(range(len(ITEMS)))
    for (_, got), want in zip(back, ITEMS):
        assert got == want
        assert all(type(lp) is TokenLogprob and type(lp.top) is tuple and all(type(t) is tuple for t in lp.top)
                   for lp in got.logprobs + [p for p in got.prompt_logprobs or [] if p is not None])
        assert type(got.matched_stop) is type(want.matched_stop)


def test_a_value_msgpack_cannot_encode_goes_pickled_and_still_round_trips():
    item = StreamItem("r-9", [torch.tensor(3)], True, "length")
    kind, payload = encode_items([(1, item)])
    assert kind == b"P"
    [(key, got)] = decode_items(kind, payload)
    assert key == 1 and got.rid == "r-9" and int(got.token_ids[0]) == 3 and got.finished


@pytest.fixture
def server():
    s = ChannelServer("127.0.0.1")
    yield s
    s.close()


async def _client(server, ctx):
    c = ChannelClient(ctx, server.endpoint, uuid.uuid4().bytes)
    await c.ready(5)
    return c


def test_one_message_per_step_and_client_with_every_request_of_that_client(server):
    async def main():
        ctx = zmq.asyncio.Context()
        a, b = await _client(server, ctx), await _client(server, ctx)
        (ka1, qa1), (ka2, qa2), (kb, qb) = a.open(), a.open(), b.open()
        ra1, ra2, rb = server.route(a.identity, ka1), server.route(a.identity, ka2), server.route(b.identity, kb)
        for step in range(5):
            server.send_step([(ra1, StreamItem("a1", [step])), (rb, StreamItem("b", [100 + step])),
                              (ra2, StreamItem("a2", [200 + step], step == 4))])
        got = {n: [await q.get() for _ in range(5)] for n, q in (("a1", qa1), ("a2", qa2), ("b", qb))}
        assert [i.token_ids[0] for i in got["a1"]] == list(range(5))
        assert [i.token_ids[0] for i in got["a2"]] == list(range(200, 205)) and got["a2"][-1].finished
        assert [i.token_ids[0] for i in got["b"]] == list(range(100, 105))
        assert server.sent_messages == 10 and a.received_messages == 5 and b.received_messages == 5
        a.close(), b.close()
        ctx.term()
    asyncio.run(main())


def test_items_keep_their_order_over_many_steps(server):
    async def main():
        ctx = zmq.asyncio.Context()
        c = await _client(server, ctx)
        key, q = c.open()
        r = server.route(c.identity, key)
        for i in range(2000):
            server.send_step([(r, StreamItem("x", [i, i + 1], i == 1999))])
        seen = [await q.get() for _ in range(2000)]
        assert [s.token_ids[0] for s in seen] == list(range(2000)) and seen[-1].finished
        c.close()
        ctx.term()
    asyncio.run(main())


def test_items_of_a_request_nobody_waits_for_are_dropped(server):
    async def main():
        ctx = zmq.asyncio.Context()
        c = await _client(server, ctx)
        (gone, _), (live, q) = c.open(), c.open()
        c.release(gone)
        server.send_step([(server.route(c.identity, gone), StreamItem("g", [1])),
                          (server.route(c.identity, live), StreamItem("l", [2], True))])
        assert (await asyncio.wait_for(q.get(), 5)).token_ids == [2]
        assert c.dropped == 1
        c.close()
        ctx.term()
    asyncio.run(main())


def test_a_client_that_never_said_hello_here_is_stale(server):
    async def main():
        ctx = zmq.asyncio.Context()
        c = await _client(server, ctx)
        server.route(c.identity, 0)
        with pytest.raises(StaleChannel):
            server.route(uuid.uuid4().bytes, 0)
        other = ChannelServer("127.0.0.1")   # a restarted worker: a new server, which never heard of c
        try:
            with pytest.raises(StaleChannel):
                other.route(c.identity, 0)
        finally:
            other.close()
        c.close()
        ctx.term()
    asyncio.run(main())


def test_a_client_of_a_server_that_does_not_answer_times_out():
    async def main():
        ctx = zmq.asyncio.Context()
        s = ChannelServer("127.0.0.1")
        endpoint = s.endpoint
        s.close()
        c = ChannelClient(ctx, endpoint, uuid.uuid4().bytes)
        with pytest.raises(asyncio.TimeoutError):
            await c.ready(0.3)
        c.close()
        ctx.term()
    asyncio.run(main())


# ---- one request's reader: the call's outcome beside the channel's items ----

async def _drain(q, timeout=5.0, grace=1.0):
    return [i async for i in request_items(q, timeout, grace)]


def test_a_call_that_returns_before_its_items_waits_for_the_last():
    async def main():
        q = asyncio.Queue()
        q.put_nowait(RETURNED)      # the Ray return overtook the channel
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, q.put_nowait, StreamItem("r", [1]))
        loop.call_later(0.1, q.put_nowait, StreamItem("r", [2], True, "length"))
        got = await _drain(q)
        assert [i.token_ids for i in got] == [[1], [2]] and got[-1].finished
    asyncio.run(main())


def test_a_last_item_that_never_comes_after_the_return_is_a_lost_channel():
    async def main():
        q = asyncio.Queue()
        for x in (StreamItem("r", [1]), RETURNED):
            q.put_nowait(x)
        got = []
        with pytest.raises(ChannelLost):
            async for i in request_items(q, 5.0, 0.1):
                got.append(i)
        assert [i.token_ids for i in got] == [[1]]
    asyncio.run(main())


def test_no_item_within_the_timeout_and_a_failed_call_raise():
    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await _drain(asyncio.Queue(), timeout=0.05)

        async def fails():
            await asyncio.sleep(0.01)
            raise ValueError("prompt: too long")
        q = asyncio.Queue()
        q.put_nowait(StreamItem("r", [1]))
        await settle(fails(), q)
        got = []
        with pytest.raises(ValueError, match="too long"):
            async for i in request_items(q, 5.0, 1.0):
                got.append(i)
        assert len(got) == 1       # the items before the failure first

        q = asyncio.Queue()
        q.put_nowait(StreamItem("r", [1], True))
        await settle(asyncio.sleep(0), q)
        assert len(await _drain(q)) == 1 and q.get_nowait() is RETURNED   # the return after the last item: unread
    asyncio.run(main())


# ---- the engine's side: one hand-off per step with every routed request's items ----

@pytest.fixture(scope="module")
def core():
    c = AsyncEngine(Engine.from_pretrained("strata-tiny", page_size=16, num_pages=128, max_batch_tokens=256))
    yield c
    c.close()


def test_a_call_whose_caller_left_is_answered_quietly(core):
    """A caller cancelled while the engine thread works (its client left): the answer that comes later is
    dropped, not set on the cancelled future (which logged an InvalidStateError per abort)."""
    async def main():
        errors = []
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        for fn in (lambda e: time.sleep(0.2), lambda e: (time.sleep(0.2), 1 / 0)):
            task = asyncio.ensure_future(core.call(fn))
            await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.sleep(0.35)
        assert await core.call(lambda e: 7) == 7
        return errors
    assert asyncio.run(main()) == []


def test_the_engine_hands_on_each_steps_items_together_and_yields_only_the_last(core):
    steps: list[list] = []
    core.on_step = steps.append
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)

    async def main():
        want = {}
        for p in ([1, 2, 3], [4, 5, 6, 7]):
            want[tuple(p)] = [t for i in [i async for i in core.generate(p, sp)] for t in i.token_ids]
        steps.clear()

        async def routed(p, tag):
            return [i async for i in core.generate(p, sp, route=tag)]
        lasts = await asyncio.gather(routed([1, 2, 3], "a"), routed([4, 5, 6, 7], "b"))
        return want, lasts
    want, lasts = asyncio.run(main())
    assert all(len(x) == 1 and x[0].finished for x in lasts)          # only the last comes back directly
    assert any({tag for tag, _ in s} == {"a", "b"} for s in steps)      # both requests' items in one step
    for tag, p in (("a", (1, 2, 3)), ("b", (4, 5, 6, 7))):
        items = [i for s in steps for t, i in s if t == tag]
        assert [t for i in items for t in i.token_ids] == want[p]
        assert [i.finished for i in items] == [False] * (len(items) - 1) + [True]


def test_closing_a_routed_request_aborts_it(core):
    steps: list[list] = []
    core.on_step = steps.append

    async def main():
        # As WorkerActor.submit runs it; ray.cancel raises CancelledError in that coroutine.
        task = asyncio.ensure_future(_run(core.generate([9, 9, 9], SamplingParams(max_new_tokens=2000,
                                                                                  ignore_eos=True), route="x")))
        while not steps:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if not await core.call(lambda e: bool(e.requests)):
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the request still runs")
    asyncio.run(main())
    assert sum(len(i.token_ids) for s in steps for _, i in s) < 2000


def test_engine_to_client_over_a_socket(core, server):
    core.on_step = server.send_step

    async def main():
        ctx = zmq.asyncio.Context()
        c = await _client(server, ctx)
        sp = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=2)
        direct = [i async for i in core.generate([3, 1, 4, 1, 5], sp)]
        key, q = c.open()
        route = server.route(c.identity, key)
        call = asyncio.ensure_future(settle(_run(core.generate([3, 1, 4, 1, 5], sp, route=route)), q))
        got = await _drain(q)
        await call
        c.close()
        ctx.term()
        return direct, got
    direct, got = asyncio.run(main())
    def strip(items):
        return [(i.token_ids, i.logprobs, i.finished, i.finish_reason, i.prompt_tokens) for i in items]
    assert strip(got) == strip(direct) and got[-1].finished


async def _run(gen):
    async for _ in gen:
        pass


# ---- requests over the channel: no Ray call (ChannelClient.submit -> the worker's engine thread) ----

@pytest.fixture(params=["engine_thread", "request_thread"])
def serving(core, request):
    """A server whose requests go straight to the engine thread: read by that thread itself (its inbox, as
    WorkerActor wires it), or by the channel's own request thread."""
    inbox = request.param == "engine_thread"
    s = ChannelServer("127.0.0.1", on_request=lambda route, ids, params, whole: core.submit_routed(
        ids, params, route, s.send_error, whole=whole), on_abort=core.abort_routed, read_requests=not inbox)
    core.on_step = s.send_step
    if inbox:
        core.set_inbox(s.requests)
    yield s
    if inbox:
        core.detach_inbox(s.requests)
        assert s.requests.closed
    s.close()


def test_the_engine_thread_reads_the_requests_itself_and_closes_them_when_detached(core):
    """With ``read_requests=False`` no thread of the channel reads requests: the engine thread takes each off
    the socket (its inbox), idle or between steps, and the commands other threads send still wake it;
    detached, it closes the socket and the server closes at once."""
    seen: list[str] = []

    def on_request(route, ids, params, whole):
        seen.append(threading.current_thread().name)
        core.submit_routed(ids, params, route, s.send_error, whole=whole)
    s = ChannelServer("127.0.0.1", on_request=on_request, on_abort=core.abort_routed, read_requests=False)
    core.on_step = s.send_step
    core.set_inbox(s.requests)
    assert "strata-token-requests" not in {t.name for t in threading.enumerate()}
    sp = SamplingParams(max_new_tokens=5, ignore_eos=True)

    async def main():
        ctx = zmq.asyncio.Context()
        c = await _requester(s, ctx)
        got = []
        for p in ([3, 1, 4], [1, 5, 9, 2], [6, 5, 3]):   # one at a time: each wakes an idle engine thread
            k, q = c.open()
            c.submit(k, p, sp)
            got.append([t for i in await _items(q) for t in i.token_ids])
            assert await core.call(lambda e: e.has_unfinished()) is False   # a command wakes it too
        keys = [c.open() for _ in range(3)]   # several at once: read between its steps
        for k, _ in keys:
            c.submit(k, list(range(3, 30)), SamplingParams(max_new_tokens=20, ignore_eos=True))
        together = await asyncio.gather(*(_items(q) for _, q in keys))
        c.close()
        ctx.term()
        return got, together
    got, together = asyncio.run(main())
    direct = [core.call_blocking(lambda e, p=p: e.generate(p, sp)[0].token_ids) for p in ([3, 1, 4], [1, 5, 9, 2],
                                                                                        [6, 5, 3])]
    assert got == direct and all(len(t) == 20 for t in (sum((i.token_ids for i in r), []) for r in together))
    assert seen == ["strata-engine"] * 6 and s.received_requests == 6
    core.detach_inbox(s.requests)
    assert s.requests.closed and core._inbox is None
    t = time.monotonic()
    s.close()
    assert time.monotonic() - t < 1.0


def test_a_request_that_comes_while_the_engine_steps_is_served_between_its_steps(core, serving):
    """A request sent while the engine thread decodes another starts at the next step, not once the engine
    is idle again: the short one is over while the long one still runs."""
    async def main():
        ctx = zmq.asyncio.Context()
        c = await _requester(serving, ctx)
        k1, q1 = c.open()
        c.submit(k1, list(range(3, 30)), SamplingParams(max_new_tokens=600, ignore_eos=True))
        long_items = request_items(q1, 30.0, 5.0)
        await long_items.__anext__()   # the engine thread is stepping now
        k2, q2 = c.open()
        c.submit(k2, [3, 1, 4], SamplingParams(max_new_tokens=3, ignore_eos=True))
        short = [t for i in await _items(q2) for t in i.token_ids]
        running = await core.call(lambda e: e.has_unfinished())   # the long one
        c.abort(k1)
        while await core.call(lambda e: e.has_unfinished()):
            await asyncio.sleep(0.01)
        c.close()
        ctx.term()
        return short, running
    short, running = asyncio.run(main())
    assert len(short) == 3 and running is True


async def _requester(server, ctx):
    c = ChannelClient(ctx, server.endpoint, uuid.uuid4().bytes, server.requests_endpoint)
    await c.ready(5)
    return c


async def _items(q, timeout=30.0):
    return [i async for i in request_items(q, timeout, 5.0)]


def test_requests_sent_over_the_channel_stream_the_engines_items(core, serving):
    sp = SamplingParams(max_new_tokens=7, ignore_eos=True, logprobs=True, top_logprobs=2)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], list(range(40))]

    async def main():
        direct = [[i async for i in core.generate(p, sp)] for p in prompts]
        ctx = zmq.asyncio.Context()
        c = await _requester(serving, ctx)
        keys = [c.open() for _ in prompts]
        for (k, _), p in zip(keys, prompts):
            c.submit(k, p, sp)
        got = await asyncio.gather(*(_items(q) for _, q in keys))
        c.close()
        ctx.term()
        return direct, got
    direct, got = asyncio.run(main())

    def strip(items):   # tokens (the logprobs' values depend on the batch they were computed in)
        return ([t for i in items for t in i.token_ids], [lp.token_id for i in items for lp in i.logprobs],
                [len(lp.top) for i in items for lp in i.logprobs], items[-1].finish_reason)
    assert [strip(g) for g in got] == [strip(d) for d in direct]
    assert all(g[-1].finished and g[-1].prompt_tokens == len(p) for g, p in zip(got, prompts))
    assert serving.received_requests == 3
    assert not core.engine.requests and not core._by_route


@pytest.mark.parametrize("seconds", [3600.0, 0.0])
def test_a_whole_request_comes_merged_with_the_tokens_of_a_streamed_one(core, serving, monkeypatch, seconds):
    """A non-streamed (whole) request's items leave the worker merged, every WHOLE_SEND_TOKENS tokens and at
    its end (or each once its first token is WHOLE_SEND_SECONDS old), with how long its first token waited;
    the tokens, logprobs and accounting are the streamed request's, and a streamed request beside it still
    gets one item per step."""
    monkeypatch.setattr(async_engine, "WHOLE_SEND_SECONDS", seconds)
    n_new = WHOLE_SEND_TOKENS * 2 + 7
    sp = SamplingParams(max_new_tokens=n_new, ignore_eos=True, logprobs=True, top_logprobs=2)
    prompt = list(range(3, 40))

    async def main():
        ctx = zmq.asyncio.Context()
        c = await _requester(serving, ctx)
        (ks, qs), (kw, qw) = c.open(), c.open()
        c.submit(ks, prompt, sp)
        c.submit(kw, prompt, sp, whole=True)
        streamed, whole = await asyncio.gather(_items(qs), _items(qw))
        c.close()
        ctx.term()
        return streamed, whole
    streamed, whole = asyncio.run(main())
    assert len(streamed) == n_new and all(len(i.token_ids) == 1 and i.held_s == 0 for i in streamed)
    if seconds:
        assert [len(i.token_ids) for i in whole] == [WHOLE_SEND_TOKENS, WHOLE_SEND_TOKENS, 7]
        assert all(i.held_s > 0 for i in whole) and [i.finished for i in whole] == [False, False, True]
    else:   # no time to hold: one item per step, as streamed
        assert [len(i.token_ids) for i in whole] == [1] * n_new and whole[-1].finished
    flat = lambda items: ([t for i in items for t in i.token_ids], [lp.token_id for i in items for lp in i.logprobs])
    assert flat(whole) == flat(streamed) and len(flat(whole)[1]) == n_new
    for f in ("finish_reason", "prompt_tokens", "cached_tokens", "matched_stop"):
        assert getattr(whole[-1], f) == getattr(streamed[-1], f), f
    assert not core.engine.requests and not core._by_route


def test_merged_items_keep_every_token_logprob_and_the_last_accounting():
    lp = [TokenLogprob(t, -0.5 * t) for t in range(4)]
    a = StreamItem("r", [0], prompt_tokens=3, logprobs=lp[:1], prompt_logprobs=[None, TokenLogprob(9, -1.0)])
    merge_items(a, StreamItem("r", [1, 2], logprobs=lp[1:3]))
    merge_items(a, StreamItem("r", [3], True, "stop", 3, 2, {"L1": 2}, None, lp[3:], None, 7))
    assert a == StreamItem("r", [0, 1, 2, 3], True, "stop", 3, 2, {"L1": 2}, None, lp,
                           [None, TokenLogprob(9, -1.0)], 7)


def test_a_refused_request_is_raised_as_its_kind_and_others_go_on(core, serving):
    async def main():
        ctx = zmq.asyncio.Context()
        c = await _requester(serving, ctx)
        (kb, qb), (kg, qg) = c.open(), c.open()
        c.submit(kb, [1, 10**9], SamplingParams(max_new_tokens=2))      # a token id outside the vocabulary
        c.submit(kg, [1, 2], SamplingParams(max_new_tokens=2, ignore_eos=True))
        with pytest.raises(ValueError, match="prompt"):
            await _items(qb)
        good = await _items(qg)
        c._push.send_multipart((b"S", c.identity, (99).to_bytes(8, "little"), b"not a pickle"))
        k3, q3 = 99, asyncio.Queue()
        c._queues[k3] = q3
        with pytest.raises(ValueError, match="cannot be read"):
            await _items(q3)
        c.close()
        ctx.term()
        return good
    assert sum(len(i.token_ids) for i in asyncio.run(main())) == 2


def test_an_abort_over_the_channel_stops_the_request(core, serving):
    async def main():
        ctx = zmq.asyncio.Context()
        c = await _requester(serving, ctx)
        k, q = c.open()
        c.submit(k, [7, 7, 7], SamplingParams(max_new_tokens=3000, ignore_eos=True))
        await q.get()
        c.abort(k)
        for _ in range(300):
            if not await core.call(lambda e: bool(e.requests)):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the aborted request still runs")
        c.close()
        ctx.term()
    asyncio.run(main())
    assert not core._by_route


def test_a_flush_hold_defers_a_request_over_the_channel_until_it_ends(core, serving):
    async def main():
        ctx = zmq.asyncio.Context()
        c = await _requester(serving, ctx)
        assert await core.hold(30.0) is None
        k, q = c.open()
        c.submit(k, [5, 6], SamplingParams(max_new_tokens=2, ignore_eos=True))
        await asyncio.sleep(0.2)
        assert q.empty() and not await core.call(lambda e: bool(e.requests))   # not admitted while held
        core.release()
        got = await _items(q)
        c.close()
        ctx.term()
        return got
    assert sum(len(i.token_ids) for i in asyncio.run(main())) == 2


def test_a_worker_that_goes_away_fails_every_open_request_of_its_channel(core):
    s = ChannelServer("127.0.0.1", on_request=lambda route, ids, params, whole: None)   # takes requests, answers none

    async def main():
        ctx = zmq.asyncio.Context()
        c = await _requester(s, ctx)
        opened = [c.open() for _ in range(3)]
        for k, _ in opened:
            c.submit(k, [1], SamplingParams(max_new_tokens=1))
        await asyncio.sleep(0.1)
        s.close()       # as a dead worker's process: its sockets close
        for _, q in opened:
            with pytest.raises(ChannelLost, match="dropped"):
                await _items(q, timeout=10)
        assert c.closed
        with pytest.raises(ChannelLost):
            c.submit(c.open()[0], [1], SamplingParams(max_new_tokens=1))
        c.close()
        ctx.term()
    asyncio.run(main())


# ---- a P/D request over the channel (HANDOFF): its wire, no Ray ------------------------------------

def test_a_handoff_reaches_its_handler_and_its_end_and_errors_come_back_as_theirs():
    """HANDOFF carries the request, the lease and where the decode half's items go; the prefill worker's
    DONE is the call's return (RETURNED) and its errors keep their kind: a PeerFailed the worker it names
    (the ingress retries away from it), StaleChannel, TransferError; an unreadable HANDOFF is refused."""
    from actors.handoff import PeerFailed, Reservation
    from actors.token_channel import Handoff
    from storage.transfer import TransferError
    got: list = []
    answers = {0: "done", 1: PeerFailed("decode worker d0: the actor died", "d0"), 2: StaleChannel("restarted"),
               3: TransferError("the lease's time was used up"), 4: KeyError("odd")}
    s = None

    def on_handoff(route, h):
        got.append((route.key, h))
        a = answers[route.key]
        s.send_step([(route, StreamItem("r", [7], True, "prefill"))])
        s.send_done(route) if a == "done" else s.send_error(route, a)
    s = ChannelServer("127.0.0.1", on_request=lambda *a: None, on_abort=lambda r: None, on_handoff=on_handoff)

    async def main():
        ctx = zmq.asyncio.Context()
        c = await _requester(s, ctx)
        res = Reservation.new("d0", 3)
        out = []
        for k in range(5):
            key, q = c.open()
            c.handoff(key, Handoff([1, 2, 3], SamplingParams(max_new_tokens=4), False, res, b"ingress", 40 + k,
                                   "tcp://127.0.0.1:9"))
            first = await asyncio.wait_for(q.get(), 5)
            assert first.token_ids == [7] and first.finish_reason == "prefill"
            out.append(await asyncio.wait_for(q.get(), 5))
        key, q = c.open()
        c._push.send_multipart((b"D", c.identity, key.to_bytes(8, "little"), b"not a pickle"))
        out.append(await asyncio.wait_for(q.get(), 5))
        c.close()
        ctx.term()
        return out, res
    try:
        (done, peer, stale, transfer, other, unreadable), res = asyncio.run(main())
    finally:
        s.close()
    assert done is RETURNED
    assert isinstance(peer, PeerFailed) and peer.worker == "d0" and "died" in str(peer)
    assert isinstance(stale, StaleChannel) and isinstance(transfer, TransferError)
    assert type(other) is RuntimeError and "odd" in str(other)
    assert isinstance(unreadable, ValueError) and "cannot be read" in str(unreadable)
    assert [k for k, _ in got] == [0, 1, 2, 3, 4]
    h = got[0][1]
    assert (h.ids, h.res, h.decode_channel, h.decode_key, h.whole, h.decode_requests) == \
        ([1, 2, 3], res, b"ingress", 40, False, "tcp://127.0.0.1:9")
    assert h.params == SamplingParams(max_new_tokens=4)


def test_a_leased_decode_half_reaches_its_handler_with_its_kv_out_of_band():
    """LEASED, from a prefill worker's LeasedSender to a decode worker's request endpoint: the ingress's
    route (its identity and key), the receipt with its ray_object KV bit for bit (out of band: the pickle
    itself stays small), the params; an unreadable one is refused to the route's client, which waits for
    it; a sender past its queue's bound (nobody reads) says so instead of blocking."""
    from actors.token_channel import Leased, LeasedSender
    from storage.transfer.base import Receipt
    from storage.transfer.payload import KVPayload
    from tests.util import free_port
    got: list = []
    s = ChannelServer("127.0.0.1", on_request=lambda *a: None, on_abort=lambda r: None,
                      on_leased=lambda route, d: got.append((route, d)))
    g = torch.Generator().manual_seed(4)
    kv = KVPayload(40, 9, 16, torch.randn(2, 3, 512, generator=g).to(torch.bfloat16),
                   torch.randn(2, 1, 512, generator=g).to(torch.bfloat16), 2, 32, 2, "file://h/l3")
    rec = Receipt(40, 9, 2, 32, kv.nbytes, packed=kv, sender="p0")
    sender = LeasedSender(hwm=2)

    async def main():
        ctx = zmq.asyncio.Context()
        c = await _requester(s, ctx)
        key, q = c.open()
        sender.send(s.requests_endpoint, c.identity, key, Leased([1, 2, 3], "lease-1", rec,
                                                                 SamplingParams(max_new_tokens=4), True))
        bad, bq = c.open()
        sender._socks[s.requests_endpoint].send_multipart([b"L", c.identity, bad.to_bytes(8, "little"), b"junk"])
        refused = await asyncio.wait_for(bq.get(), 5)
        c.close()
        ctx.term()
        return key, refused
    try:
        key, refused = asyncio.run(main())
        nobody = f"tcp://127.0.0.1:{free_port()}"
        with pytest.raises(ChannelLost, match="reads no requests"):
            for _ in range(100):
                sender.send(nobody, b"x", 0, Leased([1], "l", None, SamplingParams(), False))
    finally:
        sender.close()
        s.close()
    assert isinstance(refused, ValueError) and "cannot be read" in str(refused)
    [(route, d)] = got
    assert route.key == key and (d.ids, d.lease_id, d.whole) == ([1, 2, 3], "lease-1", True)
    assert d.params == SamplingParams(max_new_tokens=4)
    p = d.receipt.packed
    assert d.receipt._replace(packed=None) == rec._replace(packed=None)
    assert (p.prompt_len, p.offloaded_pages, p.offloaded_to) == (40, 2, "file://h/l3")
    for a, b in ((p.full, kv.full), (p.swa, kv.swa)):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_a_reserve_over_the_channel_answers_the_destination_or_the_refusal_as_its_kind():
    """RESERVE, from a prefill worker's channel to a decode worker's request endpoint: the handler gets the
    lease's arguments and its answer (a Destination) comes back on the asker's DEALER alone; a refusal keeps
    its kind (the pool full: MemoryError; a bad lease id: ValueError; TransferError), an unreadable RESERVE
    is refused, no answer within the timeout is a TimeoutError, and a worker that goes away fails the
    reserve at once (ChannelLost), not at its timeout."""
    from actors.token_channel import Reserve
    from storage.transfer import Destination, TransferError
    got: list = []
    refusals = {"d0/full": MemoryError("no room for 64 pages"), "d0/bad": ValueError("lease_id must start with"),
                "d0/late": TransferError("the lease's time was used up")}
    s = None

    def on_reserve(route, r):
        got.append((route, r))
        if r.lease_id == "d0/silent":
            return
        if r.lease_id in refusals:
            s.send_error(route, refusals[r.lease_id])
        else:
            s.send_reserved(route, Destination(r.lease_id, "ray_object", r.prompt_len, 16, [3, 4, 5], [5], 2, 29.5, "d0"))
    s = ChannelServer("127.0.0.1", on_request=lambda *a: None, on_abort=lambda r: None, on_reserve=on_reserve)

    async def main():
        ctx = zmq.asyncio.Context()
        c, other = await _requester(s, ctx), await _requester(s, ctx)
        okey, oq = other.open()
        # several at once: each answer goes to its own reserve
        dests = await asyncio.gather(*(c.reserve(Reserve(40 + k, "p0", f"d0/l{k}"), 5) for k in range(3)))
        errors = [await _raised(c.reserve(Reserve(40, "p0", lid), 5)) for lid in ("d0/full", "d0/bad", "d0/late")]
        key, q = c.open()
        c._push.send_multipart((b"V", c.identity, key.to_bytes(8, "little"), b"junk"))
        unreadable = await asyncio.wait_for(q.get(), 5)
        silent = await _raised(c.reserve(Reserve(1, "p0", "d0/silent"), 0.3))
        assert oq.empty() and other.received_messages == 0   # nothing of c's went to the other client
        pending = asyncio.ensure_future(c.reserve(Reserve(1, "p0", "d0/silent"), 30))
        await asyncio.sleep(0.2)
        s.close()
        lost = await _raised(asyncio.wait_for(pending, 10))
        c.close()
        other.close()
        ctx.term()
        return dests, errors, unreadable, silent, lost
    try:
        dests, errors, unreadable, silent, lost = asyncio.run(main())
    finally:
        s.close()
    assert [(d.lease_id, d.prompt_len, d.full_pages, d.swa_pages, d.worker_id) for d in dests] == \
        [(f"d0/l{k}", 40 + k, [3, 4, 5], [5], "d0") for k in range(3)]
    assert [type(e) for e in errors] == [MemoryError, ValueError, TransferError]
    assert "no room" in str(errors[0]) and "time was used up" in str(errors[2])
    assert isinstance(unreadable, ValueError) and "cannot be read" in str(unreadable)
    assert isinstance(silent, asyncio.TimeoutError)
    assert isinstance(lost, ChannelLost)
    assert [r for _, r in got][:3] == [Reserve(40 + k, "p0", f"d0/l{k}") for k in range(3)]


async def _raised(aw):
    try:
        await aw
    except BaseException as e:  # noqa: BLE001 - what it raised is the result
        return e
    raise AssertionError("expected an exception")
