"""The P/D handoff coordinator (actors/handoff.py) over an in-memory Workers protocol: the order of the
calls, the cached counts on the items, and the lease cancelled on every path that does not commit it
(prefill failure, an answer done at its first token, a client that leaves); and the prefill worker's
half, its prefill overlapped with the decode worker's reserve (``prefill_reserving``)."""
import asyncio
import time

import pytest

from actors.handoff import KVHandoff, Reservation, prefill_reserving
from engine.stream import PrefillResult, StreamItem
from engine.sampling import SamplingParams
from storage.transfer import Destination, TransferError


class Recorder:
    """The Workers protocol in memory: the prefill worker's first item, then the decode worker's."""

    def __init__(self, first_reason="prefill", fail_prefill=False, n=3):
        self.calls, self.first_reason, self.fail_prefill, self.n = [], first_reason, fail_prefill, n

    async def handoff(self, prefill, ids, params, res, whole=False):
        self.calls.append(("handoff", prefill, res))
        try:
            if self.fail_prefill:
                raise RuntimeError("prefill died")
            yield StreamItem("r", [7], finished=True, finish_reason=self.first_reason, cached_tokens=16,
                             cached_tokens_by_tier={"L1": 16, "L2": 0, "L3": 0})
            self.calls.append(("decode", res.decode, res.lease_id))
            for i in range(self.n):
                yield StreamItem("r", [8 + i], finished=i == self.n - 1,
                                 finish_reason="length" if i == self.n - 1 else None)
        finally:
            self.calls.append(("closed",))

    def cancel(self, decode, lease_id):
        self.calls.append(("cancel", decode, lease_id))

    async def generate(self, worker, ids, params, whole=False):
        self.calls.append(("generate", worker))
        yield StreamItem("r", [1], finished=True, finish_reason="length")


async def _all(agen):
    return [x async for x in agen]


SP = SamplingParams(max_new_tokens=4)


def test_a_handoff_names_the_lease_sends_commits_and_never_cancels_a_committed_lease():
    w = Recorder()
    items = asyncio.run(_all(KVHandoff(w).run([1, 2, 3], SP, "prefill-0", "decode-0")))
    assert [c[0] for c in w.calls] == ["handoff", "decode", "closed"]   # one request, no cancel
    res = w.calls[0][2]
    assert isinstance(res, Reservation) and res.decode == "decode-0" and res.prompt_len == 3
    assert res.lease_id.startswith("decode-0/") and w.calls[1][1:] == ("decode-0", res.lease_id)
    assert [i.token_ids for i in items] == [[7], [8], [9], [10]]
    assert not items[0].finished and items[0].finish_reason is None
    assert items[-1].finished and items[-1].cached_tokens == 16
    assert items[-1].cached_tokens_by_tier == {"L1": 16, "L2": 0, "L3": 0}


@pytest.mark.parametrize("case", ["prefill fails", "done at first token", "client leaves"])
def test_every_path_that_does_not_commit_cancels_the_lease(case):
    w = Recorder(fail_prefill=case == "prefill fails", first_reason="stop" if case == "done at first token" else "prefill")

    async def go():
        gen = KVHandoff(w).run([1, 2, 3], SP, "prefill-0", "decode-0")
        if case == "client leaves":
            await gen.__anext__()
            await gen.aclose()
            return
        return await _all(gen)
    if case == "prefill fails":
        with pytest.raises(RuntimeError):
            asyncio.run(go())
    else:
        items = asyncio.run(go())
        if case == "done at first token":
            assert [i.token_ids for i in items] == [[7]] and items[0].finished and items[0].finish_reason == "stop"
    lease_id = w.calls[0][2].lease_id
    # the workers' part is closed (a client that left aborts it) before the lease is cancelled
    assert w.calls[-2:] == [("closed",), ("cancel", "decode-0", lease_id)]
    assert "decode" not in [c[0] for c in w.calls]


def test_a_client_that_leaves_during_the_decode_closes_the_handoff_and_keeps_the_committed_lease():
    w = Recorder(n=5)

    async def go():
        gen = KVHandoff(w).run([1, 2, 3], SP, "prefill-0", "decode-0")
        got = [await gen.__anext__() for _ in range(3)]
        await gen.aclose()
        return got
    assert [i.token_ids for i in asyncio.run(go())] == [[7], [8], [9]]
    assert [c[0] for c in w.calls] == ["handoff", "decode", "closed"]


def test_each_handoff_names_its_own_lease():
    ids = {Reservation.new("decode-0", 5).lease_id for _ in range(1000)}
    assert len(ids) == 1000 and all(i.startswith("decode-0/") for i in ids)


def test_a_colocated_route_generates_on_one_worker():
    w = Recorder()
    items = asyncio.run(_all(KVHandoff(w).run([1], SP, "colocated-0", None)))
    assert w.calls == [("generate", "colocated-0")] and [i.token_ids for i in items] == [[1]]


@pytest.mark.parametrize("max_new", [0, 1])
def test_a_request_without_a_decode_phase_stays_on_its_prefill_worker(max_new):
    """At most one new token: nothing to decode, so no lease, no transfer and no decode call at all."""
    w = Recorder()
    items = asyncio.run(_all(KVHandoff(w).run([1, 2], SamplingParams(max_new_tokens=max_new), "prefill-0",
                                              "decode-0")))
    assert w.calls == [("generate", "prefill-0")] and items[-1].finished


# ---- the prefill worker's half: its prefill and the decode worker's reserve at once ------------------
DEST = Destination("decode-0/x", "ray_object", 3, 16, [0], [], 0, 30.0, "decode-0")


def _prefilled(reason="prefill"):
    return PrefillResult(StreamItem("r", [7], finished=True, finish_reason=reason), object() if reason == "prefill" else None)


class Prefill:
    """An engine's prefill that takes ``seconds`` (or fails), and says whether it was stopped."""

    def __init__(self, seconds=0.05, reason="prefill", fail=False):
        self.seconds, self.reason, self.fail, self.stopped = seconds, reason, fail, False

    async def __call__(self):
        try:
            await asyncio.sleep(self.seconds)
        except asyncio.CancelledError:
            self.stopped = True
            raise
        if self.fail:
            raise ValueError("bad prompt")
        return _prefilled(self.reason)


async def _reserve(seconds, error=None):
    await asyncio.sleep(seconds)
    if error is not None:
        raise error
    return DEST


def _overlap(prefill, reserve_s, error=None, wait=5.0):
    async def go():
        reserve = asyncio.ensure_future(_reserve(reserve_s, error))
        t0 = time.monotonic()
        try:
            return await prefill_reserving(prefill(), reserve, wait, "decode worker decode-0"), time.monotonic() - t0
        finally:
            await asyncio.sleep(0.01)     # the stopped prefill's cancellation runs
            prefill.reserve_done = reserve.done()
    return asyncio.run(go())


def test_the_reserve_runs_during_the_prefill_not_before_it():
    (res, dest), took = _overlap(Prefill(0.2), 0.2)
    assert dest is DEST and res.first.token_ids == [7] and took < 0.35     # not 0.4: at once
    (res, dest), took = _overlap(Prefill(0.2), 0.05)                        # the reserve answers first
    assert dest is DEST and res.first.token_ids == [7] and 0.2 <= took < 0.35
    (res, dest), took = _overlap(Prefill(0.05), 0.2)
    assert dest is DEST and took >= 0.2                                     # the send waits for its pages


@pytest.mark.parametrize("error", [MemoryError("decode: running batch is full"), TransferError("cancelled first")])
def test_a_failed_reserve_stops_the_prefill_and_is_what_the_caller_sees(error):
    p = Prefill(5.0)
    with pytest.raises(type(error), match=str(error)):
        _overlap(p, 0.05, error)
    assert p.stopped            # nothing computed (or exported) for pages that do not exist


def test_a_failed_reserve_after_the_prefill_still_sends_nothing():
    with pytest.raises(MemoryError):
        _overlap(Prefill(0.01), 0.1, MemoryError("no pages"))


def test_an_answer_done_at_its_first_token_does_not_wait_for_the_reserve():
    p = Prefill(0.01, reason="length")
    (res, dest), took = _overlap(p, 1.0)
    assert dest is None and res.payload is None and took < 0.5 and not p.reserve_done


def test_a_failed_prefill_is_the_error_and_the_reserve_is_left_to_land():
    p = Prefill(0.01, fail=True)
    with pytest.raises(ValueError, match="bad prompt"):
        _overlap(p, 0.3)
    assert not p.reserve_done   # its lease (if any) is the ingress's to cancel


def test_a_reserve_slower_than_the_send_time_fails_the_transfer():
    with pytest.raises(TransferError, match="decode-0 did not lease the pages within 0.2 s"):
        _overlap(Prefill(0.01), 2.0, wait=0.2)


def test_a_caller_that_leaves_stops_the_prefill():
    p = Prefill(5.0)

    async def go():
        reserve = asyncio.ensure_future(_reserve(5.0))
        task = asyncio.ensure_future(prefill_reserving(p(), reserve, 10.0))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.01)
        reserve.cancel()
    asyncio.run(go())
    assert p.stopped


def test_the_ingress_maps_what_the_prefill_workers_reserve_met():
    """Over Ray the prefill worker's errors come wrapped (RayTaskError): a decode worker it could not reach
    is that worker's failure (retried away from it), a refusal keeps its kind (400 / 503)."""
    import ray
    from actors.frontend import ServiceUnavailable, WorkerFailed
    from actors.handoff import PeerFailed
    from actors.ingress import _unwrap

    def wrapped(cause):
        return ray.exceptions.RayTaskError("prefill_to", "Traceback", cause)
    e = _unwrap(wrapped(PeerFailed("decode worker decode-0: the actor died", "decode-0")))
    assert isinstance(e, WorkerFailed) and e.workers == ("decode-0",) and "decode-0" in str(e)
    assert isinstance(_unwrap(wrapped(MemoryError("decode: running batch is full"))), MemoryError)
    assert isinstance(_unwrap(wrapped(TransferError("cancelled before it was reserved"))), ServiceUnavailable)
    import pickle
    p = pickle.loads(pickle.dumps(PeerFailed("gone", "decode-1")))
    assert p.worker == "decode-1" and str(p) == "gone"
