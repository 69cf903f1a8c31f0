"""Engine A computes a prefix and writes it through L2 to L3; a fresh engine B that never saw it is
served from L3 with the tokens of a recomputation -- on every backend that runs here (the real
mooncake_master and NIXL agents, no mocks). A page then damaged in the store is a miss: recomputed."""
import pytest
import torch

from engine import Engine, SamplingParams
from storage.config import HiCacheConfig

from .conftest import backend_server, store_config
from .test_contract import corrupt
from tests import numerics

SP = SamplingParams(max_new_tokens=8, ignore_eos=True)


@pytest.mark.numerics
def test_engine_b_is_served_engine_a_prefix_from_l3(backend, tmp_path, request):
    l3 = store_config(backend, tmp_path / "l3", backend_server(backend, request))

    def engine():
        return Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256, enable_prefix_cache=True,
                                      poison_kv=True, hicache=HiCacheConfig(host_pages=256, l3=l3))

    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 256, (8 * 64,), generator=g).tolist()   # 8x the window
    a = engine()
    first = a.generate([prompt], SP)[0]
    a.cache.poll(block=True)   # drains the backups and the L3 writes they enqueue
    assert a.cache.l3.stats["written_pages"] > 0
    b = engine()
    turn2 = prompt + first.token_ids + [11] * 24
    got = b.generate([turn2], SP)[0]
    ref = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256)
    want = ref.generate([turn2], numerics.with_logits(SP))[0]
    assert got.cached_tokens_by_tier["L3"] >= 16 * (len(prompt) // 16) - 16, got.cached_tokens_by_tier
    numerics.assert_same_output(got, want, ref.model_config)
    b.check_integrity()
    b.cache.poll(block=True)
    # A page damaged in the store (here: mid-prompt) is detected on read and the prefix recomputed.
    keys = b.cache.tree.page_keys(prompt)
    corrupt(b.cache.l3.store, b.cache.l3.keys([keys[10]], "full")[0], "flip")
    c = engine()
    again = c.generate([turn2], SP)[0]
    numerics.assert_same_output(again, want, ref.model_config)
    assert again.cached_tokens_by_tier["L3"] == 0 and c.cache.l3.store.stats()["corrupt"] == 1
    c.check_integrity()
    for e in (a, b, c):
        e.flush_cache()
        assert e.pools.all_free() and e.cache.host.all_free()
        e.close()
