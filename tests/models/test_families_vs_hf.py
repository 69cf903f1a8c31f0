"""Each supported family against transformers on the very same checkpoint: greedy tokens and logits
under tests/numerics, with chunked prefill, prompts of several windows, the prefix served from L1, L2
and L3, and prefill on one engine with decode on another."""
import pytest
import torch

from engine import Engine, SamplingParams
from engine.model.loader import load_config
from storage.config import HiCacheConfig
from storage.l3 import L3Config
from tests import numerics, pd
from tests.unit.hf_ref import hf_greedy

from .families import WINDOWS

pytestmark = pytest.mark.numerics
N_NEW = 10
SP = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)


def _prompts(family: str, seed: int = 3) -> list[list[int]]:
    w = WINDOWS.get(family, 16)
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 7, w - 1, w, w + 1, 3 * w + 5, 6 * w)]


def _engine(path, **kw):
    kw.setdefault("page_size", 4)
    kw.setdefault("num_pages", 512)
    kw.setdefault("max_batch_tokens", 40)
    return Engine.from_pretrained(str(path), poison_kv=True, **kw)


def test_greedy_tokens_and_logits_match_transformers(family):
    name, path, hf = family
    eng = _engine(path)
    mc = eng.model_config
    assert mc.architecture == hf.config.architectures[0]
    assert len(eng.pools.swa.layer_ids) == len(mc.sliding_layers)   # no SWA pool without sliding layers
    prompts = _prompts(name)
    outs = eng.generate(prompts, numerics.with_logits(SP))
    assert max(map(len, prompts)) > eng.cfg.effective_chunk_size       # chunked prefill happened
    for p, o in zip(prompts, outs):
        numerics.assert_same_output(o, hf_greedy(hf, p, N_NEW), mc, f"{name}, prompt of {len(p)} tokens")
    assert eng.pools.all_free()
    eng.check_integrity()


def _turn2(name: str, first: list[int], out: list[int]) -> list[int]:
    g = torch.Generator().manual_seed(11)
    return first + out + torch.randint(0, 256, (2 * WINDOWS.get(name, 16) + 3,), generator=g).tolist()


def test_prefix_from_l1_l2_and_l3_matches_transformers(family, tmp_path):
    name, path, hf = family
    # Every prefix past L1/L2 is looked up, however short (these prompts are a few windows long).
    l3 = L3Config(backend="file", path=str(tmp_path / "l3"), prefetch_policy="wait_complete", prefetch_min_tokens=0)

    def engine():
        return _engine(path, enable_prefix_cache=True, hicache=HiCacheConfig(host_pages=512, l3=l3))

    first = _prompts(name)[-1]
    a = engine()
    out1 = a.generate([first], SP)[0]
    prompt = _turn2(name, first, out1.token_ids)
    want = hf_greedy(hf, prompt, N_NEW)
    mc = a.model_config
    from_l1 = a.generate([prompt], SP)[0]
    assert from_l1.cached_tokens_by_tier["L1"] > 0, from_l1.cached_tokens_by_tier
    numerics.assert_same_output(from_l1, want, mc, f"{name} from L1")
    a.cache.poll(block=True)
    for c in ("full", "swa"):
        a.cache.evict_l1(c, 1 << 30)
    from_l2 = a.generate([prompt], SP)[0]
    assert from_l2.cached_tokens_by_tier["L2"] > 0 and from_l2.cached_tokens_by_tier["L1"] == 0
    numerics.assert_same_output(from_l2, want, mc, f"{name} from L2")
    a.check_integrity()
    a.cache.poll(block=True)
    # Another engine continues the conversation (the next turn: an L3 match ends where a's last
    # sliding window was kept, at the end of its last answer).
    b = engine()
    prompt3 = _turn2(name, prompt, from_l2.token_ids)
    from_l3 = b.generate([prompt3], SP)[0]
    assert from_l3.cached_tokens_by_tier["L3"] > 0, from_l3.cached_tokens_by_tier
    numerics.assert_same_output(from_l3, hf_greedy(hf, prompt3, N_NEW), mc, f"{name} from L3")
    for e in (a, b):
        e.check_integrity()
        e.flush_cache()
        assert e.pools.all_free()
        e.close()


def test_prefill_on_one_engine_decode_on_another_matches_transformers(family):
    name, path, hf = family
    pre, dec = _engine(path), _engine(path)
    prompts = _prompts(name, seed=5)[2:]
    drids = pd.handoff(pre, dec, prompts, SP)
    while dec.has_unfinished():
        dec.step()
        dec.check_integrity()
    for p, r in zip(prompts, drids):
        numerics.assert_same_output(dec.pop_finished(r), hf_greedy(hf, p, N_NEW), dec.model_config,
                                    f"{name} PD, prompt of {len(p)}")
    assert pre.pools.all_free() and dec.pools.all_free()


def test_config_reads_what_transformers_reads(family):
    name, path, hf = family
    mc, c = load_config(path), hf.config
    assert mc.layer_types == tuple(c.layer_types) if hasattr(c, "layer_types") and c.layer_types else True
    assert mc.num_hidden_layers == c.num_hidden_layers and mc.head_dim == c.head_dim
    if mc.sliding_layers:
        assert mc.sliding_window == c.sliding_window == WINDOWS[name]
    assert len(mc.moe_layer_ids) == sum(1 for layer in hf.model.layers
                                         if hasattr(layer.mlp, "experts"))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss_mxfp4"], indirect=True)
def test_moe_families_keep_transformers_tokens_while_eplb_moves_experts(family):
    """Expert slots (EPLB) on the MoE families: placements applied between steps of running
    generations, and the tokens are still transformers'."""
    from engine.eplb import EplbConfig, rebalance
    name, path, hf = family
    mc = load_config(path)
    e = mc.num_local_experts
    eng = _engine(path, eplb=EplbConfig(num_ranks=4, num_redundant_experts=4, auto=False))
    assert eng.expert_reading().phy2log.shape == (len(mc.moe_layer_ids), e + 4)
    prompts = _prompts(name)[2:]
    rids = [eng.add_request(p, numerics.with_logits(SP)) for p in prompts]
    step, moved = 0, 0
    while eng.has_unfinished():
        eng.step()
        step += 1
        if step % 3 == 0:
            moved += eng.apply_placement(rebalance(eng.expert_load(), e + 4, 1, 1, 4)[0]).moved_slots
    assert moved > 0
    for p, r in zip(prompts, rids):
        numerics.assert_same_output(eng.pop_finished(r), hf_greedy(hf, p, N_NEW), mc, f"{name} with EPLB")
