"""The SWA-aware host backup (the kept windows) against the benches' SWA-oblivious baseline
(bench/swa_oblivious.py: host room for every token of the sliding layers). Same tokens either way; the
oblivious one costs more host memory, by the factor bench/multiturn_offline's bound predicts, and frees
all of it. The baseline lives in bench/ only: production config has no field for it."""
import contextlib
import dataclasses

import pytest
import torch

from bench.swa_oblivious import ObliviousHiCache, ObliviousHostTier, installed, oblivious_config
from engine import Engine, SamplingParams
from storage.config import HiCacheConfig
from storage.hicache import HiCache, HostTier

SP = SamplingParams(max_new_tokens=8, ignore_eos=True)


def _turns(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5 * 64 + 3, 41, 29)]


def _run(oblivious: bool, write_policy: str):
    hc = HiCacheConfig(host_pages=256, write_policy=write_policy)
    with installed() if oblivious else contextlib.nullcontext():
        eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=96, max_batch_tokens=128,
                                     enable_prefix_cache=True, poison_kv=True,
                                     hicache=oblivious_config(hc) if oblivious else hc)
    assert type(eng.cache) is (ObliviousHiCache if oblivious else HiCache)
    prompt, outs = [], []
    for text in _turns(0):
        prompt = prompt + (outs[-1][0] if outs else []) + text
        eng.cache.poll(block=True)
        for c in ("full", "swa"):       # serve every turn from L2: the backups must be complete and right
            eng.cache.evict_l1(c, 1 << 30)
        rid = eng.add_request(prompt, SP)
        while eng.has_unfinished():
            eng.step()
            eng.check_integrity()
        o = eng.pop_finished(rid)
        outs.append((o.token_ids, o.cached_tokens_by_tier["L2"]))
    eng.cache.poll(block=True)
    eng.check_integrity()
    used = eng.cache.host.bytes_used()
    eng.flush_cache()
    eng.check_integrity()
    assert eng.cache.host.all_free() and eng.pools.all_free()
    eng.close()
    return outs, used


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_aware_and_oblivious_give_identical_tokens(write_policy):
    aware, used_aware = _run(False, write_policy)
    oblivious, used_obl = _run(True, write_policy)
    assert [t for t, _ in aware] == [t for t, _ in oblivious]
    assert all(hits > 0 for _, hits in aware[1:]) and all(hits > 0 for _, hits in oblivious[1:])
    assert used_aware["full"] == used_obl["full"]
    # Oblivious: one host SWA page per host full page (same per-page bytes on strata-tiny: 2+2 layers).
    assert used_obl["swa"] == used_obl["full"]
    # Aware: the kept windows only (each prompt's and answer's end, one checkpoint per 256 tokens; the
    # interior sliding KV stays in L1, evictable, never backed up): 0.54x here, with prompts this short.
    assert used_aware["swa"] < used_obl["swa"] * 0.6


def test_the_oblivious_sizing_is_the_benchs():
    assert "swa_backup" not in {f.name for f in dataclasses.fields(HiCacheConfig)}
    assert HiCacheConfig(host_pages=100).host_swa_pages == 50   # SWA-aware: host_swa_ratio of host_pages
    assert oblivious_config(HiCacheConfig(host_pages=100)).host_swa_pages == 100


def test_the_oblivious_baseline_lives_in_bench():
    def l2_of(eng):
        tier = type(eng.cache._l2)
        eng.close()
        return tier
    kw = dict(page_size=16, num_pages=32, enable_prefix_cache=True, hicache=HiCacheConfig(host_pages=16))
    assert l2_of(Engine.from_pretrained("strata-tiny", **kw)) is HostTier   # what serving builds
    with installed():
        assert l2_of(Engine.from_pretrained("strata-tiny", **kw)) is ObliviousHostTier
    assert l2_of(Engine.from_pretrained("strata-tiny", **kw)) is HostTier   # only inside the block
