"""Prefill on one engine, decode on another: the same tokens as one engine doing both."""
import pytest
import torch

from engine import Engine, SamplingParams
from storage.config import HiCacheConfig
from tests import numerics


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
        rids = [pre.add_request(p, sp, prefill_only=True) for p in _prompts()]
        while pre.has_unfinished():
            pre.step()
            pre.check_integrity()
        payloads = [pre.pop_finished(r) and pre_payload for r, pre_payload in
                    [(r, pre.requests[r].kv_payload) for r in rids]]
        drids = [dec.add_prefilled(p, kv, sp) for p, kv in zip(_prompts(), payloads)]
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
    rid = pre.add_request(list(range(100)), sp, prefill_only=True)
    while pre.has_unfinished():
        pre.step()
    kv = pre.requests[rid].kv_payload
    assert pre.pop_finished(rid).finish_reason == "prefill"
    dec = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=64)
    with pytest.raises(ValueError, match="kv payload"):
        dec.add_prefilled(list(range(99)), kv, sp)
    other_ps = Engine.from_pretrained("strata-tiny", page_size=8, num_pages=64)
    with pytest.raises(ValueError, match="page_size"):
        other_ps.add_prefilled(list(range(100)), kv, sp)
    tiny = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=8, swa_full_ratio=1.0)
    held = tiny.pools.full.allocator.alloc(4)   # another request's pages: 4 left, 7 needed
    with pytest.raises(MemoryError):
        tiny.add_prefilled(list(range(100)), kv, sp)
    tiny.pools.full.allocator.free(held)
    for e in (dec, other_ps, tiny):
        assert e.pools.all_free() and not e.requests
