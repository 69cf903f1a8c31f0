"""Prefill->decode transfer, pure parts: the lease table, pack/unpack of the ray_object backend, and
two engines handing KV through leased pages (no Ray)."""
import pytest
import torch

from engine import Engine, SamplingParams
from storage.config import HiCacheConfig
from storage.pools import PageAllocator
from storage.geometry import KVGeometry
from storage.transfer.base import Destination, LeaseTable, TransferError, coalesce
from storage.transfer.config import TransferConfig
from storage.transfer.ray_object import RayObjectBackend, pack, unpack
from tests import numerics


def _table(n_full=10, n_swa=6):
    return LeaseTable({"full": PageAllocator(n_full, "full"), "swa": PageAllocator(n_swa, "swa")})


def _all_free(t: LeaseTable) -> bool:
    return all(a.num_free == a.num_pages for a in t.allocators.values())


def test_lease_expires_only_once_its_time_has_passed():
    t = _table()
    t.reserve("a", {"full": 3, "swa": 2}, now=100.0, ttl=5.0)
    t.reserve("b", {"full": 2, "swa": 1}, now=102.0, ttl=5.0)
    t.check_integrity()
    assert t.expire(104.9) == [] and t.stats()["pages"] == {"full": 5, "swa": 3}
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
    assert (n_full, first, n_swa) == (128, 124, 4)
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


def _dest(lease, backend="ray_object", ps=16):
    return Destination(lease.lease_id, backend, lease.meta["prompt_len"], ps, lease.pages["full"],
                       lease.pages["swa"], lease.meta["swa_first_page"], 5.0)


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
        leases = [dec.reserve_kv(f"l{_round}-{i}", len(p), now=0.0, ttl=10.0) for i, p in enumerate(_prompts())]
        dec.check_integrity()
        rids = [pre.add_request(p, sp, prefill_only=True) for p in _prompts()]
        while pre.has_unfinished():
            pre.step()
        payloads = [pre.requests[r].kv_payload for r in rids]
        for r in rids:
            pre.pop_finished(r)
        drids = []
        for p, kv, lease in zip(_prompts(), payloads, leases):
            rec = be.send(kv, _dest(lease), timeout=5.0)
            packed, rec = rec.packed, rec._replace(packed=None)
            fill = lambda pools, l, packed=packed: unpack(packed, l.pages["full"], l.pages["swa"],
                                                          l.meta["swa_first_page"], pools)
            drids.append(dec.add_leased(p, lease.lease_id, rec, sp, now=1.0, fill=fill))
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
    prompt = list(range(100))
    rid = pre.add_request(prompt, sp, prefill_only=True)
    while pre.has_unfinished():
        pre.step()
    kv = pre.requests[rid].kv_payload
    info = RayObjectBackend().send(kv, _dest(dec.reserve_kv("x", 100, 0.0, 1.0)), 1.0)
    dec.leases.cancel("x")
    # expired lease: a clean TransferError, nothing held
    dec.reserve_kv("a", 100, now=0.0, ttl=1.0)
    with pytest.raises(TransferError):
        dec.add_leased(prompt, "a", info, sp, now=2.0)
    # wrong prompt for the lease: ValueError, lease gone
    dec.reserve_kv("b", 100, now=0.0, ttl=1.0)
    with pytest.raises(ValueError):
        dec.add_leased(prompt[:50], "b", info, sp, now=0.5)
    # a payload that does not fit (another prompt length): refused by pack
    lease = dec.reserve_kv("c", 99, now=0.0, ttl=1.0)
    with pytest.raises(TransferError):
        pack(kv, _dest(lease))
    dec.leases.cancel("c")
    # a failing fill frees the committed pages
    dec.reserve_kv("d", 100, now=0.0, ttl=1.0)

    def boom(pools, lease):
        raise RuntimeError("copy failed")
    with pytest.raises(RuntimeError):
        dec.add_leased(prompt, "d", info, sp, now=0.5, fill=boom)
    with pytest.raises(ValueError):
        dec.reserve_kv("e", 0, now=0.0, ttl=1.0)
    dec.check_integrity()
    assert dec.pools.all_free() and not dec.leases.leases and not dec.requests


def test_reserve_refuses_what_the_pools_cannot_hold():
    dec = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=16)
    dec.reserve_kv("a", 200, 0.0, 1.0)
    with pytest.raises(MemoryError):
        dec.reserve_kv("b", 200, 0.0, 1.0)
    dec.check_integrity()
    dec.leases.expire(1.0)
    assert dec.pools.all_free()


@pytest.mark.numerics
def test_staging_descriptors_land_each_layer_page_in_the_leased_page():
    """The address arithmetic of the one-sided backends, with the WRITE done by memmove in-process: the
    decode engine then produces exactly the tokens of one engine doing both."""
    import ctypes

    from storage.transfer.base import check_fits, receipt
    from storage.transfer.staging import Staging, pool_regions
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompts = _prompts()
    want = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=128).generate(prompts, numerics.with_logits(sp))
    pre = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=128)
    dec = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=128, poison_kv=True)
    dec.reserve_kv("pad", 40, 0.0, 10.0)      # so leased page indices are not simply 0, 1, 2...
    staging = Staging(256, pre.pools)
    rids = [pre.add_request(p, sp, prefill_only=True) for p in prompts]
    while pre.has_unfinished():
        pre.step()
    got = []
    for i, (p, rid) in enumerate(zip(prompts, rids)):
        kv = pre.requests[rid].kv_payload
        lease = dec.reserve_kv(f"l{i}", len(p), 0.0, 10.0)
        dest = _dest(lease, backend="nixl")
        dest.peer = pool_regions(dec.pools)
        off = check_fits(kv, dest)
        full_idx, swa_idx = staging.stage(f"s{i}", kv, 0.0, 5.0)
        spans = staging.spans(full_idx, swa_idx, kv, dest, off)
        assert sum(n for _, _, n in spans) == kv.nbytes
        for src, dst, n in spans:
            ctypes.memmove(dst, src, n)
        assert staging.release(f"s{i}")
        rid2 = dec.add_leased(p, lease.lease_id, receipt(kv), sp, now=1.0)
        while dec.has_unfinished():
            dec.step()
        got.append(dec.pop_finished(rid2))
        dec.check_integrity()
    numerics.assert_same_outputs(got, want, dec.model_config, "staged")
    staging.check_integrity()
    assert staging.stats()["staging_pages_used"] == 0
    dec.leases.cancel("pad")
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
