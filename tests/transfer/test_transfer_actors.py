"""Prefill->decode KV transfer between two real worker actors on a local Ray cluster, for every backend
(ray_object, real NIXL agents over UCX, real Mooncake transfer engines over tcp on 127.0.0.1): greedy
tokens equal Engine.generate (the prefill worker reserving on the decode worker during its prefill, as
for the ingress), and failures (a stalled send, a dead decode worker, a reserve its cancel overtook)
free every page."""
from __future__ import annotations

import time

import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.model.checkpoint import resolve_model_path
from storage.transfer import TransferConfig
from storage.transfer.base import Receipt
from tests import numerics

ray = pytest.importorskip("ray")

PROMPTS = [[5, 6, 7], list(range(90)), [i % 256 for i in range(3, 300)]]
SP = SamplingParams(max_new_tokens=10, ignore_eos=True)


def _can_run(backend: str) -> str | None:
    try:
        if backend == "nixl":
            from storage.l3.nixl import _load_nixl
            _load_nixl()
        elif backend == "mooncake":
            from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


@pytest.fixture(scope="module")
def model_path():
    return str(resolve_model_path("strata-tiny"))


@pytest.fixture(scope="module")
def reference(model_path):
    eng = Engine.from_pretrained(model_path, page_size=16, num_pages=256)
    return eng.model_config, eng.generate(PROMPTS, numerics.with_logits(SP))


def _pair(model_path, tcfg: TransferConfig):
    from actors.worker import WorkerActor
    ecfg = EngineConfig(model=model_path, page_size=16, num_pages=256, poison_kv=True, torch_threads=1)
    pre = WorkerActor.options(num_cpus=0.5, max_restarts=0).remote("p0", "prefill", ecfg, None, transfer_cfg=tcfg)
    dec = WorkerActor.options(num_cpus=0.5, max_restarts=0).remote("d0", "decode", ecfg, None, transfer_cfg=tcfg)
    ray.get([pre.start.remote(), dec.start.remote()], timeout=180)
    return pre, dec


def _serve(pre, dec, ids, sp=SP) -> list[int]:
    """As the ingress serves: one call to the prefill worker, which reserves the lease named here on the
    decode worker (by its handle: these actors have no names) while it computes the prompt."""
    from actors.handoff import Reservation
    res = Reservation.new("d0", len(ids))
    first_ref, sent_ref = pre.prefill_to.remote(ids, sp, res, dec)
    first = ray.get(first_ref, timeout=120)
    toks = list(first.token_ids)
    for ref in dec.decode_leased.remote(ids, res.lease_id, sent_ref, sp):
        toks += ray.get(ref, timeout=120).token_ids
    return toks


def _used(stats) -> int:
    return sum(p["used"] for p in stats["pool"].values())


@pytest.fixture(scope="module")
def pairs(ray_session, model_path):
    """One (prefill, decode) pair per backend, shared by the tests of this module (in file order)."""
    made = {}

    def get(backend: str):
        err = _can_run(backend)
        if err:
            pytest.skip(f"{backend} cannot load here: {err}")
        if backend not in made:
            made[backend] = _pair(model_path, TransferConfig(backend=backend, lease_seconds=60.0,
                                                             transfer_timeout=30.0, staging_pages=512))
        return made[backend]
    yield get
    for pair in made.values():
        for w in pair:
            ray.kill(w)


@pytest.mark.parametrize("backend", ["ray_object", "nixl", "mooncake"])
@pytest.mark.numerics
def test_greedy_tokens_through_each_backend_equal_engine_generate(pairs, reference, backend):
    pre, dec = pairs(backend)
    mc, want = reference      # later prompts reuse the peer connection
    numerics.assert_same_outputs([_serve(pre, dec, ids) for ids in PROMPTS], want, mc, backend)
    for w in (pre, dec):
        assert _used(ray.get(w.stats.remote())) == 0
    ts = ray.get(pre.transfer_stats.remote()).sends
    if backend != "ray_object":
        assert ts.sends == len(PROMPTS) and ts.staging_pages_used == 0 and ts.bytes > 0
    assert ray.get(dec.transfer_stats.remote()).leases.committed == len(PROMPTS)


# Not rerun under other ATen paths (make test's numerics reruns): what it checks is where pages go; the
# tokens of the same transfers are checked on every path by the greedy test above.
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_a_write_landing_after_its_lease_ended_never_changes_another_requests_tokens(pairs, model_path, reference,
                                                                                    backend):
    """The send is posted 2.5 s late and not aborted (test hook) while its lease lasts 1.5 s. The lease's
    pages are quarantined, not freed: the request that takes pages next (the allocator hands out the
    last freed first) decodes right through the late write with the reference tokens; once the sender's
    send is over, the quarantined pages go back."""
    from storage.transfer import TransferError
    pre, dec = pairs(backend)
    victim = [(i * 7 + 1) % 256 for i in range(150)]
    long_sp = SamplingParams(max_new_tokens=300, ignore_eos=True)
    want = Engine.from_pretrained(model_path, page_size=16, num_pages=256).generate(
        [victim], numerics.with_logits(long_sp))
    ray.get(dec.set_transfer_options.remote(lease_seconds=1.5, transfer_timeout=1.0, expiry_interval=0.1))
    ray.get(pre.set_transfer_options.remote(lease_seconds=1.5, transfer_timeout=1.0, debug_write_delay=2.5))
    try:
        before = ray.get(dec.transfer_stats.remote()).leases
        ids = PROMPTS[2]
        dest = ray.get(dec.reserve.remote(len(ids), "p0", pre), timeout=60)
        first_ref, _ = pre.prefill_to.remote(ids, SP, dest, dec)
        deadline = time.monotonic() + 30
        while ray.get(dec.transfer_stats.remote()).leases.expired == before.expired:
            assert time.monotonic() < deadline, "the lease never ended"
            time.sleep(0.05)
        got = []
        for ref in dec.generate.remote(victim, long_sp):   # runs while the late write lands
            got += ray.get(ref, timeout=120).token_ids
        try:
            ray.get(first_ref, timeout=120)    # nixl: the late send completes; mooncake: it overran
        except ray.exceptions.RayTaskError as e:
            assert isinstance(e.cause, TransferError)
        deadline = time.monotonic() + 30
        while (st := ray.get(dec.transfer_stats.remote()).leases).in_quarantine:
            assert time.monotonic() < deadline, f"quarantine never released: {st}"
            time.sleep(0.1)
        numerics.assert_same_outputs([got], want, reference[0], f"{backend} late write")
        assert st.quarantined - before.quarantined == 1 and st.released - before.released == 1
        assert ray.get(dec.check_integrity.remote())
        for w in (pre, dec):
            assert _used(ray.get(w.stats.remote())) == 0
        assert ray.get(pre.transfer_stats.remote()).sends.staging_pages_used == 0
    finally:
        for w in (pre, dec):
            ray.get(w.set_transfer_options.remote(lease_seconds=60.0, transfer_timeout=30.0, debug_write_delay=0.0))


def test_a_stalled_transfer_times_out_cleanly_and_frees_both_sides(pairs):
    from storage.transfer import TransferError
    pre, dec = pairs("ray_object")
    # The send waits 3 s (test hook) but the lease lasts 2 s: the lease expires on the decode side and the
    # prefill side gives up before sending.
    ray.get(dec.set_transfer_options.remote(lease_seconds=2.0, transfer_timeout=1.5, expiry_interval=0.1))
    ray.get(pre.set_transfer_options.remote(lease_seconds=2.0, transfer_timeout=1.5, debug_send_delay=3.0))
    try:
        ids = PROMPTS[1]
        dest = ray.get(dec.reserve.remote(len(ids)), timeout=60)
        assert ray.get(dec.transfer_stats.remote()).leases.live == 1
        first_ref, sent_ref = pre.prefill_to.remote(ids, SP, dest)
        with pytest.raises(ray.exceptions.RayTaskError) as ei:
            ray.get(first_ref, timeout=120)
        assert isinstance(ei.value.cause, TransferError)
        st = ray.get(dec.transfer_stats.remote()).leases
        assert st.live == 0 and st.expired == 1
        # a late commit is refused, not served from freed pages
        with pytest.raises(ray.exceptions.RayTaskError, match="expired or was cancelled"):
            for ref in dec.decode_leased.remote(ids, dest.lease_id, Receipt(len(ids), 1, 0, 0), SP):
                ray.get(ref, timeout=60)
        for w in (pre, dec):
            assert _used(ray.get(w.stats.remote())) == 0
    finally:
        for w in (pre, dec):
            ray.get(w.set_transfer_options.remote(lease_seconds=60.0, transfer_timeout=30.0, debug_send_delay=0.0))


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_killing_the_decode_worker_mid_transfer_frees_the_prefill_side(pairs, backend):
    from storage.transfer import TransferError
    pre, dec = pairs(backend)
    lease = 20.0
    ray.get(pre.set_transfer_options.remote(lease_seconds=lease, transfer_timeout=10.0, debug_send_delay=1.5))
    ids = PROMPTS[2]
    b0 = ray.get(pre.transfer_stats.remote()).sends
    dest = ray.get(dec.reserve.remote(len(ids)), timeout=60)
    first_ref, _ = pre.prefill_to.remote(ids, SP, dest)
    time.sleep(0.5)
    t0 = time.monotonic()
    ray.kill(dec)                       # dies while the prefill side is about to write
    with pytest.raises(ray.exceptions.RayTaskError) as ei:
        ray.get(first_ref, timeout=120)
    assert isinstance(ei.value.cause, TransferError)
    assert time.monotonic() - t0 < lease
    ts = ray.get(pre.transfer_stats.remote()).sends
    assert ts.staging_pages_used == 0 and ts.failed + ts.timeouts - b0.failed - b0.timeouts == 1
    assert _used(ray.get(pre.stats.remote())) == 0


def test_a_prefill_workers_reserve_refused_or_unanswered_reaches_its_caller_and_sends_nothing(ray_session, model_path):
    """The ingress's cancel overtook the prefill worker's reserve: refused (nothing leased, nothing sent);
    done at the first token: nothing sent, the lease cancelled; a dead decode worker: PeerFailed naming
    it (the ingress's WorkerFailed, so a retry avoids it); the prefill side holds no page after any."""
    from actors.handoff import PeerFailed, Reservation
    from storage.transfer import TransferError
    pre, dec = _pair(model_path, TransferConfig(backend="ray_object", lease_seconds=60.0, transfer_timeout=30.0))
    try:
        ids = PROMPTS[1]
        res = Reservation.new("d0", len(ids))
        assert not ray.get(dec.cancel.remote(res.lease_id), timeout=60)
        first_ref, sent_ref = pre.prefill_to.remote(ids, SP, res, dec)
        with pytest.raises(ray.exceptions.RayTaskError, match="cancelled before it was reserved") as ei:
            ray.get(first_ref, timeout=120)
        assert isinstance(ei.value.cause, TransferError)
        st = ray.get(dec.transfer_stats.remote()).leases
        assert st.live == 0 and st.reserved == 0

        res = Reservation.new("d0", len(ids))
        first_ref, sent_ref = pre.prefill_to.remote(ids, SamplingParams(max_new_tokens=1), res, dec)
        first = ray.get(first_ref, timeout=120)
        assert first.finished and first.finish_reason == "length" and ray.get(sent_ref, timeout=60) is None
        ray.get(dec.cancel.remote(res.lease_id), timeout=60)     # as the ingress does
        deadline = time.monotonic() + 30
        while ray.get(dec.transfer_stats.remote()).leases.live:  # a reserve behind the cancel is refused
            assert time.monotonic() < deadline, "the lease of an answer done at its first token stayed"
            time.sleep(0.05)

        with pytest.raises(ray.exceptions.RayTaskError, match="lease_id must be"):
            ray.get(dec.reserve.remote(len(ids), "p0", None, "elsewhere/1"), timeout=60)

        ray.kill(dec)
        first_ref, _ = pre.prefill_to.remote(ids, SP, Reservation.new("d0", len(ids)), dec)
        with pytest.raises(ray.exceptions.RayTaskError) as ei:
            ray.get(first_ref, timeout=120)
        assert isinstance(ei.value.cause, PeerFailed) and ei.value.cause.worker == "d0"
        assert _used(ray.get(pre.stats.remote())) == 0
    finally:
        for w in (pre, dec):
            ray.kill(w)
