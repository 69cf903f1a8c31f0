"""Prefill->decode transfer, pure parts: the lease table, pack/fill of the ray_object backend, and
two engines handing KV through leased pages (no Ray)."""
import pytest
import torch

from engine import Engine, SamplingParams
from storage.config import HiCacheConfig
from storage.pools import PageAllocator
from storage.geometry import KVGeometry
from storage.transfer.base import LeaseTable, PeerInfo, TransferBackend, TransferError, coalesce
from storage.transfer.config import TransferConfig
from storage.transfer.ray_object import RayObjectBackend, pack
from tests import numerics, pd


def _table(n_full=10, n_swa=6):
    return LeaseTable({"full": PageAllocator(n_full, "full"), "swa": PageAllocator(n_swa, "swa")})


def _all_free(t: LeaseTable) -> bool:
    return all(a.num_free == a.num_pages for a in t.allocators.values())


def test_lease_expires_only_once_its_time_has_passed():
    t = _table()
    t.reserve("a", {"full": 3, "swa": 2}, now=100.0, ttl=5.0)
    t.reserve("b", {"full": 2, "swa": 1}, now=102.0, ttl=5.0)
    t.check_integrity()
    assert t.expire(104.9) == [] and t.stats().pages == {"full": 5, "swa": 3}
    assert [l.lease_id for l in t.expire(105.0)] == ["a"]
    t.check_integrity()
    with pytest.raises(TransferError, match="expired"):
        t.commit("a", 105.0)
    # a lease past its deadline is expired by commit itself, even before the expiry sweep ran
    with pytest.raises(TransferError):
        t.commit("b", 107.5)
    t.check_integrity()
    assert _all_free(t) and t.counts["expired"] == 2


def test_cancel_commit_and_double_commit():
    t = _table()
    t.reserve("a", {"full": 4, "swa": 2}, 0.0, 1.0)
    t.reserve("b", {"full": 1, "swa": 1}, 0.0, 1.0)
    assert t.cancel("a") and not t.cancel("a")
    t.check_integrity()
    lease = t.commit("b", 0.5)
    assert len(lease.pages["full"]) == 1 and len(lease.pages["swa"]) == 1
    with pytest.raises(TransferError):
        t.commit("b", 0.5)              # committed pages belong to the caller now
    assert not t.cancel("b")
    t.allocators["full"].free(lease.pages["full"])
    t.allocators["swa"].free(lease.pages["swa"])
    t.check_integrity()
    assert _all_free(t) and t.counts == {"reserved": 2, "committed": 1, "cancelled": 1, "expired": 0, "quarantined": 0, "released": 0}


def test_reserve_is_all_or_nothing_and_rejects_bad_input():
    t = _table(n_full=4, n_swa=2)
    with pytest.raises(MemoryError):
        t.reserve("a", {"full": 3, "swa": 3}, 0.0, 1.0)
    assert _all_free(t)
    t.reserve("a", {"full": 3, "swa": 2}, 0.0, 1.0)
    for bad in (dict(lease_id="a", need={"full": 1}), dict(lease_id="c", need={"gpu": 1}),
                dict(lease_id="d", need={"full": -1})):
        with pytest.raises(ValueError):
            t.reserve(now=0.0, ttl=1.0, **bad)
    with pytest.raises(ValueError):
        t.reserve("e", {"full": 1}, 0.0, 0.0)
    assert t.cancel_all() == 1 and _all_free(t)
    t.check_integrity()


def test_check_integrity_catches_a_page_freed_under_a_lease():
    t = _table()
    lease = t.reserve("a", {"full": 2, "swa": 0}, 0.0, 1.0)
    t.allocators["full"].free(lease.pages["full"][:1])
    with pytest.raises(AssertionError):
        t.check_integrity()


def test_plan_pages_reserves_full_prompt_and_last_window_only():
    assert KVGeometry(16, 64).plan_pages(1) == (1, 0, 1)
    assert KVGeometry(16, 64).plan_pages(64) == (4, 0, 4)
    n_full, first, n_swa = KVGeometry(16, 64).plan_pages(32 * 64)
    assert (n_full, first, n_swa) == (128, 123, 5)   # a repeat's window, before page 127, too
    assert KVGeometry(16, None).plan_pages(100) == (7, 0, 0)


def test_coalesce_merges_runs_contiguous_on_both_sides():
    assert coalesce([(16, 200, 8), (24, 208, 8), (0, 100, 8), (8, 108, 8), (40, 216, 8)]) == \
        [(0, 100, 16), (16, 200, 16), (40, 216, 8)]


def test_transfer_config_validates_fields():
    TransferConfig()
    for bad, field in ((dict(backend="rdma"), "backend"), (dict(lease_seconds=0), "lease_seconds"),
                       (dict(transfer_timeout=40.0), "transfer_timeout"), (dict(staging_pages=0), "staging_pages"),
                       (dict(mooncake_protocol="udp"), "mooncake_protocol"), (dict(debug_send_delay=-1), "debug_send_delay")):
        with pytest.raises(ValueError, match=field):
            TransferConfig(**bad)


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 16, 65, 200, 333)]


@pytest.mark.numerics
@pytest.mark.parametrize("cache", [False, True])
def test_leased_transfer_between_engines_gives_identical_tokens_and_frees_everything(cache):
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    whole = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256)
    want = whole.generate(_prompts(), numerics.with_logits(sp))
    kw = dict(enable_prefix_cache=True, hicache=HiCacheConfig(host_pages=128)) if cache else {}
    pre = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256, poison_kv=True, **kw)
    dec = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256, poison_kv=True, **kw)
    be = RayObjectBackend()
    for _round in range(2):
        dests = [pd.reserve(dec, len(p), be, now=0.0, ttl=10.0) for p in _prompts()]
        dec.check_integrity()
        payloads = pd.prefill(pre, _prompts(), sp)
        drids = []
        for p, kv, dest in zip(_prompts(), payloads, dests):
            drids.append(pd.send_and_admit(dec, p, dest, kv, sp, be, now=1.0))
            dec.check_integrity()
        while dec.has_unfinished():
            dec.step()
        numerics.assert_same_outputs([dec.pop_finished(r) for r in drids], want, dec.model_config, "leased")
        dec.check_integrity()
    for eng in (pre, dec):
        if cache:
            eng.flush_cache()
        assert eng.pools.all_free()


def test_failed_commits_free_the_leased_pages():
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    pre = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=64)
    dec = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=64, poison_kv=True)
    be = RayObjectBackend()
    prompt = list(range(100))
    [kv] = pd.prefill(pre, [prompt], sp)
    x = pd.reserve(dec, 100, be, 0.0, 1.0)
    info = be.send(kv, x, 1.0)
    assert dec.receiver.cancel(x.lease_id)
    # expired lease: a clean TransferError, nothing held
    a = pd.reserve(dec, 100, be, now=0.0, ttl=1.0)
    with pytest.raises(TransferError):
        dec.add_leased(prompt, a.lease_id, info, sp, be, now=2.0)
    # wrong prompt for the lease: ValueError, lease gone
    b = pd.reserve(dec, 100, be, now=0.0, ttl=1.0)
    with pytest.raises(ValueError):
        dec.add_leased(prompt[:50], b.lease_id, info, sp, be, now=0.5)
    # a payload that does not fit (another prompt length): refused by pack
    c = pd.reserve(dec, 99, be, now=0.0, ttl=1.0)
    with pytest.raises(TransferError):
        pack(kv, c)
    dec.receiver.cancel(c.lease_id)
    # nothing was sent (the prefill side finished at its first token): refused, lease gone
    n = pd.reserve(dec, 100, be, now=0.0, ttl=1.0)
    with pytest.raises(TransferError, match="nothing was sent"):
        dec.add_leased(prompt, n.lease_id, None, sp, be, now=0.5)
    # a failing fill frees the committed pages
    d = pd.reserve(dec, 100, be, now=0.0, ttl=1.0)

    class Boom(RayObjectBackend):
        def fill(self, pools, pages, rec):
            raise RuntimeError("copy failed")
    with pytest.raises(RuntimeError):
        dec.add_leased(prompt, d.lease_id, info, sp, Boom(), now=0.5)
    # a receipt without its payload cannot fill a two-sided lease
    e = pd.reserve(dec, 100, be, now=0.0, ttl=1.0)
    with pytest.raises(TransferError, match="carries no KV"):
        dec.add_leased(prompt, e.lease_id, info._replace(packed=None), sp, be, now=0.5)
    with pytest.raises(ValueError):
        dec.reserve_kv("e", 0, now=0.0, ttl=1.0)
    dec.check_integrity()
    assert dec.pools.all_free() and dec.receiver.live == 0 and not dec.requests


def test_tick_expires_and_names_quarantined_senders_at_most_once_a_second():
    dec = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=64)
    r = dec.receiver
    r.reserve("a", 40, 0.0, 1.0, one_sided=True, sender="p0")
    r.reserve("b", 40, 0.0, 1.0, one_sided=True)            # no sender known: nobody to ask
    r.reserve("c", 40, 0.0, 5.0, one_sided=False, sender="p1")
    sweep = r.tick(0.5)
    assert sweep.expired == [] and sweep.probe == []
    sweep = r.tick(1.0)
    assert sweep.expired == ["a", "b"] and sweep.quarantined == ["a", "b"] and sweep.probe == [("a", "p0")]
    dec.check_integrity()
    assert r.tick(1.5).probe == [] and r.tick(2.0).probe == [("a", "p0")]
    assert r.release("a") and r.send_ended("b") and r.tick(3.0) == ([], [], [])
    assert r.tick(5.0).expired == ["c"]                      # two-sided: free at once, never quarantined
    dec.check_integrity()
    assert dec.pools.all_free() and r.stats().in_quarantine == 0


def test_a_cancel_that_overtakes_its_reserve_refuses_it_for_as_long_as_a_lease_lasts():
    """The ingress names the lease and cancels it by name; the prefill worker reserves it meanwhile, so
    the cancel can come first. The reserve that follows is refused: no pages are leased only to wait
    for their expiry. Remembered for a lease's ttl, and at most MAX_REFUSED ids."""
    from engine.pd import MAX_REFUSED
    dec = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=64)
    r = dec.receiver
    assert not r.cancel("d/a", 0.0, 5.0)                 # nothing held under that id yet
    with pytest.raises(TransferError, match="cancelled before it was reserved"):
        dec.reserve_kv("d/a", 40, 0.5, 5.0, one_sided=True, sender="p0")
    assert r.live == 0 and r.stats().reserved == 0 and dec.pools.all_free()
    dec.check_integrity()
    dec.reserve_kv("d/b", 40, 0.5, 5.0)                  # other ids lease as ever
    assert r.cancel("d/b", 0.6, 5.0) and dec.pools.all_free()   # held: freed, nothing to remember
    dec.reserve_kv("d/b", 40, 0.7, 5.0)
    assert r.cancel("d/b")
    assert not r.cancel("d/c")                           # the engine's own cancels (no time) remember nothing
    dec.reserve_kv("d/c", 40, 1.0, 5.0)
    r.cancel("d/c")
    with pytest.raises(TransferError):
        dec.reserve_kv("d/a", 40, 4.9, 5.0)
    r.tick(5.0)                                          # a lease named then would have expired by now
    dec.reserve_kv("d/a", 40, 5.0, 5.0)
    r.cancel("d/a")
    dec.reserve_kv("d/q", 40, 5.0, 1.0, one_sided=True, sender="p0")
    r.cancel("d/q")                                      # quarantined: known, not refused
    assert not r.cancel("d/q", 5.0, 5.0) and "d/q" not in r._refused and r.release("d/q")
    for i in range(MAX_REFUSED + 10):
        r.cancel(f"d/x{i}", 6.0, 100.0)
    dec.check_integrity()
    dec.reserve_kv("d/x0", 40, 7.0, 5.0)                 # the oldest went first
    r.cancel("d/x0")
    with pytest.raises(TransferError):
        dec.reserve_kv(f"d/x{MAX_REFUSED + 9}", 40, 7.0, 5.0)
    dec.check_integrity()
    assert dec.pools.all_free() and r.live == 0 and r.stats().in_quarantine == 0


def test_reserve_refuses_what_the_pools_cannot_hold():
    dec = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=16)
    dec.reserve_kv("a", 200, 0.0, 1.0)
    with pytest.raises(MemoryError):
        dec.reserve_kv("b", 200, 0.0, 1.0)
    dec.check_integrity()
    assert dec.receiver.tick(1.0).expired == ["a"]
    assert dec.pools.all_free()


class MemmoveBackend(TransferBackend):
    """A one-sided backend in one process: ``send`` stages the payload and does the WRITE of each descriptor
    by memmove, straight into the decode engine's leased pages (the address arithmetic of NIXL and
    Mooncake); the decode side's ``fill`` is the base's: the data is in place."""

    name = "memmove"
    one_sided = True

    def __init__(self, pre_pools, dec_pools) -> None:
        from storage.transfer.staging import Staging, pool_regions
        self.staging = Staging(256, pre_pools)
        self.peer = PeerInfo(regions=pool_regions(dec_pools))
        self.n = 0

    def peer_info(self) -> PeerInfo:
        return self.peer

    def send(self, payload, dest, timeout):
        import ctypes

        from storage.transfer.base import check_fits, receipt
        off = check_fits(payload, dest)
        self.n += 1
        full_idx, swa_idx = self.staging.stage(f"s{self.n}", payload, 0.0, 5.0)
        spans = self.staging.spans(full_idx, swa_idx, payload, dest, off)
        assert sum(n for _, _, n in spans) == payload.nbytes
        for src, dst, n in spans:
            ctypes.memmove(dst, src, n)
        assert self.staging.release(f"s{self.n}")
        return receipt(payload, descriptors=len(spans))


@pytest.mark.numerics
def test_staging_descriptors_land_each_layer_page_in_the_leased_page():
    """The address arithmetic of the one-sided backends, with the WRITE done by memmove in-process: the
    decode engine then produces exactly the tokens of one engine doing both."""
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompts = _prompts()
    want = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=128).generate(prompts, numerics.with_logits(sp))
    pre = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=128)
    dec = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=128, poison_kv=True)
    be = MemmoveBackend(pre.pools, dec.pools)
    pad = pd.reserve(dec, 40, be, 0.0, 10.0)      # so leased page indices are not simply 0, 1, 2...
    rids = pd.handoff(pre, dec, prompts, sp, be, now=1.0)
    dec.check_integrity()
    while dec.has_unfinished():
        dec.step()
    got = [dec.pop_finished(rid) for rid in rids]
    dec.check_integrity()
    numerics.assert_same_outputs(got, want, dec.model_config, "staged")
    be.staging.check_integrity()
    assert be.staging.usage()[0] == 0
    dec.receiver.cancel(pad.lease_id)                 # one-sided, its send never ended: quarantined
    assert not dec.pools.all_free() and dec.receiver.send_ended(pad.lease_id)
    assert dec.pools.all_free()


def test_cluster_yaml_maps_the_transfer_section():
    from cluster.config import from_text, load_config
    assert from_text("{}").transfer == TransferConfig()
    cfg = from_text("transfer:\n  backend: nixl\n  lease_seconds: 5\n  transfer_timeout: 2\n")
    assert (cfg.transfer.backend, cfg.transfer.lease_seconds, cfg.transfer.transfer_timeout) == ("nixl", 5, 2)
    assert load_config("cluster/configs/pd-1p1d-mooncake.yaml").transfer.backend == "mooncake"
    with pytest.raises(ValueError, match="config.transfer: unknown keys"):
        from_text("transfer:\n  bakend: nixl\n")
    with pytest.raises(ValueError, match="backend"):
        from_text("transfer:\n  backend: carrier-pigeon\n")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_payload_pickles_its_kv_out_of_band_and_bit_exact(dtype):
    """The ray_object payload crosses Ray pickled: its KV as raw byte arrays that pickle protocol 5 hands
    out of band (Ray's zero-copy path), read back bit for bit, also from read-only buffers (the object
    store's) without a warning."""
    import pickle
    import warnings
    import numpy as np
    from storage.transfer.payload import KVPayload
    g = torch.Generator().manual_seed(3)
    p = KVPayload(33, 7, 16, torch.randn(4, 3, 256, generator=g).to(dtype), torch.empty(2, 0, 256, dtype=dtype),
                  2, 32, 2, "file://host/l3")
    bufs: list = []
    data = pickle.dumps(p, protocol=5, buffer_callback=bufs.append)
    assert len(bufs) == 2 and len(data) < 1024   # the KV is not in the pickle stream

    def readonly(b):
        a = np.frombuffer(b.raw(), dtype=np.uint8)
        a.flags.writeable = False
        return a
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = pickle.loads(data, buffers=[readonly(b) for b in bufs])
    assert (q.prompt_len, q.first_token, q.page_size, q.swa_first_page, q.swa_valid_from, q.offloaded_pages,
            q.offloaded_to) == (33, 7, 16, 2, 32, 2, "file://host/l3")
    for a, b in ((q.full, p.full), (q.swa, p.swa)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    r = pickle.loads(pickle.dumps(p))   # in band (protocol < 5): the same
    assert torch.equal(r.full.view(torch.uint8), p.full.view(torch.uint8)) and r.swa.shape == p.swa.shape
