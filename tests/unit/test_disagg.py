"""Prefill on one engine, decode on another (through the leased admission the cluster uses, tests/pd.py):
the same tokens as one engine doing both."""
import pytest
import torch

from engine import Engine, SamplingParams
from storage.config import HiCacheConfig
from storage.l3 import L3Config
from storage.transfer import TransferError
from storage.transfer.ray_object import RayObjectBackend
from tests import numerics, pd


def _prompts():
    g = torch.Generator().manual_seed(9)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 15, 16, 64, 65, 200, 333)]


@pytest.mark.numerics
@pytest.mark.parametrize("cache", [False, True])
def test_prefill_then_decode_on_another_engine_gives_identical_tokens(cache):
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    whole = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256)
    want = whole.generate(_prompts(), numerics.with_logits(sp))
    kw = dict(enable_prefix_cache=True, hicache=HiCacheConfig(host_pages=128)) if cache else {}
    kw["poison_kv"] = True
    pre = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256, **kw)
    dec = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256, **kw)
    for _round in range(2):  # the second round hits the caches of both sides
        drids = pd.handoff(pre, dec, _prompts(), sp)
        pre.check_integrity()
        dec.check_integrity()
        while dec.has_unfinished():
            dec.step()
            dec.check_integrity()
        got = [dec.pop_finished(r) for r in drids]
        numerics.assert_same_outputs(got, want, dec.model_config, f"round {_round}")
    for eng in (pre, dec):
        if cache:
            eng.flush_cache()
        assert eng.pools.all_free()


def test_bad_payloads_are_rejected_and_leave_nothing_behind():
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    pre = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=64)
    [kv] = pd.prefill(pre, [list(range(100))], sp)
    be = RayObjectBackend()
    dec = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=64)
    with pytest.raises(TransferError, match="kv of 100 tokens"):     # another prompt length
        pd.send_and_admit(dec, list(range(99)), pd.reserve(dec, 99, be), kv, sp, be)
    other_ps = Engine.from_pretrained("strata-tiny", page_size=8, num_pages=64)
    with pytest.raises(TransferError, match="page 16 does not match the destination's 100/8"):
        pd.send_and_admit(other_ps, list(range(100)), pd.reserve(other_ps, 100, be), kv, sp, be)
    # A receipt that does not fit the lease it is admitted over (sent for another one) is refused at fill.
    dest, other = pd.reserve(dec, 100, be), pd.reserve(dec, 100, be)
    rec = be.send(kv, dest, 1.0)
    wrong_dtype = rec._replace(packed=type(kv)(**{**vars(kv), "full": kv.full.double()}))
    with pytest.raises(TransferError, match="dtype"):
        dec.add_leased(list(range(100)), other.lease_id, wrong_dtype, sp, be)
    with pytest.raises(ValueError, match="kv transfer: covers 100 tokens"):
        dec.add_leased(list(range(99)), dest.lease_id, rec, sp, be)
    for bad in (dict(offloaded_pages=7), dict(offloaded_pages=-1), dict(offloaded_pages="6"), dict(offloaded_to=3)):
        d = pd.reserve(dec, 100, be)      # 100 tokens: 6 whole pages the sender may have offloaded
        with pytest.raises(ValueError, match="offloaded_"):
            dec.add_leased(list(range(100)), d.lease_id, be.send(kv, d, 1.0)._replace(**bad), sp, be)
    dec.check_integrity()
    tiny = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=8, swa_full_ratio=1.0)
    held = tiny.pools.full.allocator.alloc(4)   # another request's pages: 4 left, 7 needed
    with pytest.raises(MemoryError):
        pd.send_and_admit(tiny, list(range(100)), pd.reserve(tiny, 100, be), kv, sp, be)
    tiny.pools.full.allocator.free(held)
    for e in (dec, other_ps, tiny):
        assert e.pools.all_free() and not e.requests and e.receiver.live == 0


def _l3_engine(path):
    return Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256, enable_prefix_cache=True,
                                  poison_kv=True, hicache=HiCacheConfig(
                                      host_pages=256, l3=L3Config(backend="file", path=str(path),
                                                                  prefetch_policy="wait_complete")))


@pytest.mark.numerics
def test_decode_offloads_only_what_the_prefill_worker_did_not(tmp_path):
    """DESIGN, one request step 4: the decode worker offloads the finished sequence so that the next turn's
    prefill finds it in L3. The prefill worker has already written the prompt through to that store, so
    the decode worker moves only the pages it computed; one whose L3 is another store (another machine's
    directory) offloads everything, and the next turn on the prefill worker's store then stops at the
    prompt."""
    sp = SamplingParams(max_new_tokens=60, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 256, (200,), generator=g).tolist()   # 12 whole pages; 259 tokens' KV at the end
    want = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256).generate([prompt], sp)[0]
    moved, found = {}, {}
    for case, dec_store in (("same store", "a"), ("another store", "b")):
        pre, dec = _l3_engine(tmp_path / case / "a"), _l3_engine(tmp_path / case / dec_store)
        [rid] = pd.handoff(pre, dec, [prompt], sp)
        while dec.has_unfinished():
            dec.step()
            dec.check_integrity()
        out = dec.pop_finished(rid)
        assert out.token_ids == want.token_ids, case
        for e in (pre, dec):
            e.cache.poll(block=True)   # the backups, then the L3 writes they enqueue
            e.check_integrity()
        moved[case] = dec.cache.stats["pages"]["L1->L2"]
        # The next turn, prefilled by a fresh engine on the prefill worker's store.
        nxt = _l3_engine(tmp_path / case / "a")
        turn2 = prompt + out.token_ids + [9] * 30
        got = nxt.generate([turn2], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
        found[case] = got.cached_tokens_by_tier["L3"]
        nxt.check_integrity()
        for e in (pre, dec, nxt):
            e.flush_cache()
            assert e.pools.all_free() and e.cache.host.all_free()
            e.close()
    assert found["same store"] >= 256 - 16, found          # prompt (prefill worker) + output (decode worker)
    assert found["another store"] <= 192, found            # only the prompt reached this store
    assert moved["same store"] < moved["another store"], moved   # 8 against 24 pages (full + SWA)


@pytest.mark.numerics
def test_the_decode_side_serves_a_repeat_of_a_handed_off_prompt_from_its_own_cache():
    """The prefill side sends the sliding window before the repeat's cut too (one page more when the
    prompt ends on a page boundary, KVGeometry.swa_aligned_first_page), so the decode side's tree can
    serve the same prompt again (conditional disaggregation prefills such a repeat there)."""
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    g = torch.Generator().manual_seed(31)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (128, 200, 512)]
    whole = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256)
    want = whole.generate(prompts, numerics.with_logits(sp))
    kw = dict(page_size=16, num_pages=256, enable_prefix_cache=True, poison_kv=True)
    pre, dec = Engine.from_pretrained("strata-tiny", **kw), Engine.from_pretrained("strata-tiny", **kw)
    drids = pd.handoff(pre, dec, prompts, sp)
    while dec.has_unfinished():
        dec.step()
        dec.check_integrity()
    numerics.assert_same_outputs([dec.pop_finished(r) for r in drids], want, dec.model_config, "handed off")
    again = dec.generate(prompts, numerics.with_logits(sp))
    assert [o.cached_tokens for o in again] == [dec.geometry.cacheable_tokens(len(p)) for p in prompts]
    numerics.assert_same_outputs(again, want, dec.model_config, "repeated on the decode side")
    dec.check_integrity()
