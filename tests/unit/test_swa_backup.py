"""HiCacheConfig.swa_backup: the SWA-aware backup (last window) against the SWA-oblivious baseline
(host room for every token of the sliding layers). Same tokens either way; the oblivious one costs
more host memory, by the factor bench/multiturn_offline's bound predicts, and frees all of it."""
import pytest
import torch

import bench.swa_oblivious  # noqa: F401  (registers the SWA-oblivious L2 tier, swa_backup="all")
from engine import Engine, SamplingParams
from storage.config import HiCacheConfig
from storage.hicache import HOST_TIERS

SP = SamplingParams(max_new_tokens=8, ignore_eos=True)


def _turns(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5 * 64 + 3, 41, 29)]


def _run(mode: str, write_policy: str):
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=96, max_batch_tokens=128,
                                 enable_prefix_cache=True, poison_kv=True,
                                 hicache=HiCacheConfig(host_pages=256, write_policy=write_policy, swa_backup=mode))
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
    aware, used_aware = _run("last_window", write_policy)
    oblivious, used_obl = _run("all", write_policy)
    assert [t for t, _ in aware] == [t for t, _ in oblivious]
    assert all(hits > 0 for _, hits in aware[1:]) and all(hits > 0 for _, hits in oblivious[1:])
    assert used_aware["full"] == used_obl["full"]
    # Oblivious: one host SWA page per host full page (same per-page bytes on strata-tiny: 2+2 layers).
    assert used_obl["swa"] == used_obl["full"]
    # Aware: the kept windows only (each prompt's and answer's end, one checkpoint per 256 tokens; the
    # interior sliding KV stays in L1, evictable, never backed up): 0.54x here, with prompts this short.
    assert used_aware["swa"] < used_obl["swa"] * 0.6


def test_swa_backup_is_validated():
    with pytest.raises(ValueError, match="swa_backup"):
        HiCacheConfig(swa_backup="some")
    assert HiCacheConfig(host_pages=100, swa_backup="all").host_swa_pages == 100


def test_the_oblivious_baseline_lives_in_bench(monkeypatch):
    monkeypatch.delitem(HOST_TIERS, "all")   # as in a serving process, which never imports bench/
    with pytest.raises(ValueError, match="bench/swa_oblivious.py"):
        Engine.from_pretrained("strata-tiny", page_size=16, num_pages=32, enable_prefix_cache=True,
                               hicache=HiCacheConfig(host_pages=16, swa_backup="all"))
