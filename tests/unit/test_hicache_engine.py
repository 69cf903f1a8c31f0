"""Prefix reuse through the engine: identical tokens whether the prefix came from L1, L2 or was
recomputed; every tier empty after flush_cache()."""
import pytest
import torch

from engine import Engine, SamplingParams
from storage.config import HiCacheConfig
from tests import numerics

pytestmark = pytest.mark.numerics   # every test compares tokens with another computation's

SP = SamplingParams(max_new_tokens=12, ignore_eos=True)
SP_REF = SamplingParams(max_new_tokens=12, ignore_eos=True, return_logits=True)   # the reference's


def _conversation_turns(seed: int, turns: int, first: int, extra: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (first if i == 0 else extra,), generator=g).tolist() for i in range(turns)]


def _run(eng, new_texts, force_l2=False, check=True, sp=SP):
    """Each turn = previous prompt + its output + new text. Returns (tokens, cached_by_tier) per turn."""
    prompt, out = [], []
    for text in new_texts:
        prompt = prompt + (out[-1][0] if out else []) + text
        if force_l2:
            eng.cache.poll(block=True)  # write-through backups finish in the background
            for c in ("full", "swa"):
                eng.cache.evict_l1(c, 1 << 30)
        rid = eng.add_request(prompt, sp)
        while eng.has_unfinished():
            eng.step()
            if check:
                eng.check_integrity()
        o = eng.pop_finished(rid)
        out.append((o.token_ids, o.cached_tokens_by_tier, o.cached_tokens, o))
    return out


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_multiturn_tokens_identical_off_l1_l2(layout):
    texts = _conversation_turns(0, 6, 4 * 64 + 9, 37)   # the first prompt is already past 4x the window
    off = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=512, max_batch_tokens=96)
    ref = _run(off, texts, sp=SP_REF)
    l1 = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=512, max_batch_tokens=96,
                                enable_prefix_cache=True)
    got_l1 = _run(l1, texts)
    l2 = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=512, max_batch_tokens=96,
                                enable_prefix_cache=True, poison_kv=True,
                                hicache=HiCacheConfig(host_pages=512, layout=layout, write_policy="write_through"))
    got_l2 = _run(l2, texts, force_l2=True)
    mc = off.model_config
    numerics.assert_same_turns([o for *_, o in got_l1], [o for *_, o in ref], mc, "L1 hits")
    numerics.assert_same_turns([o for *_, o in got_l2], [o for *_, o in ref], mc, "L2 hits")
    for i in range(1, len(texts)):
        assert got_l1[i][1]["L1"] > 0 and got_l1[i][1]["L2"] == 0, got_l1[i]
        assert got_l2[i][1]["L2"] > 0 and got_l2[i][1]["L1"] == 0, got_l2[i]
        assert got_l1[i][2] >= 16 * ((len(texts[0]) + 37 * (i - 1)) // 16)
    for eng in (l1, l2):
        eng.flush_cache()
        eng.check_integrity()
        assert eng.pools.all_free()
    assert l2.cache.host.all_free()
    assert l2.stats()["cache"]["bytes"]["L2->L1"] > 0


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_write_policies_under_l1_pressure_keep_tokens_exact(policy):
    """Six conversations take turns over an L1 that holds about four: hits come from L1 and from L2,
    and the tokens never change."""
    convs = [_conversation_turns(10 + i, 3, 150, 20) for i in range(6)]
    ref_eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=400, max_batch_tokens=128)
    # Plain LRU: it evicts each conversation just before it comes back, so hits must come from L2 (the
    # default, segmented LRU, keeps these six in L1 and would not exercise the write policy at all).
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=64, max_batch_tokens=128,
                                 enable_prefix_cache=True, poison_kv=True, prefix_eviction="lru",
                                 hicache=HiCacheConfig(host_pages=256, write_policy=policy,
                                                       write_through_threshold=1))
    prompts = [[] for _ in convs]
    outs = [[] for _ in convs]
    tiers = {"L1": 0, "L2": 0}
    for turn in range(3):
        for i, c in enumerate(convs):
            prompts[i] = prompts[i] + (outs[i][-1] if outs[i] else []) + c[turn]
            want = ref_eng.generate([prompts[i]], SP_REF)[0]
            rid = eng.add_request(prompts[i], SP)
            while eng.has_unfinished():
                eng.step()
                eng.check_integrity()
            got = eng.pop_finished(rid)
            numerics.assert_same_output(got, want, eng.model_config, f"turn {turn}, conversation {i}")
            outs[i].append(got.token_ids)
            for t in tiers:
                tiers[t] += got.cached_tokens_by_tier[t]
    assert tiers["L1"] > 0 and tiers["L2"] > 0, tiers
    eng.flush_cache()
    eng.check_integrity()
    assert eng.pools.all_free() and eng.cache.host.all_free()


def test_concurrent_conversations_with_preemption_and_eviction_stay_exact():
    """Five concurrent conversations overflow L1: eviction, L2 load-back and preemption all happen at
    once; tokens equal the no-cache engine, integrity holds after every step, nothing leaks."""
    convs = [_conversation_turns(30 + i, 3, 150, 20) for i in range(5)]
    ref_eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=400, max_batch_tokens=128)
    # 48 pages: at 64 queued requests now wait for room instead of pushing running ones out, and
    # nothing would be preempted.
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=48, max_batch_tokens=128,
                                 enable_prefix_cache=True, poison_kv=True, hicache=HiCacheConfig(host_pages=256))
    prompts, outs = [[] for _ in convs], [[] for _ in convs]
    for turn in range(3):
        for i, c in enumerate(convs):
            prompts[i] = prompts[i] + (outs[i][-1] if outs[i] else []) + c[turn]
        want = ref_eng.generate(prompts, SP_REF)
        rids = [eng.add_request(p, SP) for p in prompts]
        while eng.has_unfinished():
            eng.step()
            eng.check_integrity()
        got = [eng.pop_finished(r) for r in rids]
        numerics.assert_same_outputs(got, want, eng.model_config, f"turn {turn}")
        for i, g in enumerate(got):
            outs[i].append(g.token_ids)
    st = eng.stats()
    assert st["preemptions"] > 0 and st["cache"]["evicted_pages"]["L1"] > 0
    eng.flush_cache()
    assert eng.pools.all_free() and eng.cache.host.all_free()


def test_slow_background_copies_are_waited_for_and_survive_splits(monkeypatch):
    """Copies that lag far behind the forward: loads must be waited for layer by layer, and backups
    whose node is split by a match meanwhile must land on the right pieces."""
    import time

    import storage.hicache as hc

    real_load, real_backup = hc.transfer.l2_to_l1, hc.transfer.l1_to_l2

    def slow(fn):
        def wrapped(*a, **kw):
            time.sleep(0.004)
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(hc.transfer, "l2_to_l1", slow(real_load))
    monkeypatch.setattr(hc.transfer, "l1_to_l2", slow(real_backup))
    test_concurrent_conversations_with_preemption_and_eviction_stay_exact()
    test_write_policies_under_l1_pressure_keep_tokens_exact("write_through")
