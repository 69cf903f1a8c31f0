"""L3 through the engine: a prefix one engine wrote is served to another from the shared store with the
same tokens; corrupt or missing objects are misses, never wrong tokens."""
import os

import pytest
import torch

from engine import Engine, SamplingParams
from storage.config import HiCacheConfig
from storage.kernels_path import transfer
from storage.l3 import L3Config
from storage.pools import FULL, SWA
from tests import numerics

SP = SamplingParams(max_new_tokens=8, ignore_eos=True)


def _engine(path, layout="page_first_direct", prefetch_policy="wait_complete"):
    return Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256, enable_prefix_cache=True,
                                  poison_kv=True, hicache=HiCacheConfig(host_pages=256, layout=layout,
                                                                        l3=L3Config(backend="file", path=str(path),
                                                                                    prefetch_policy=prefetch_policy)))


@pytest.fixture(scope="module")
def ref():
    return Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256)


@pytest.mark.numerics
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_second_engine_reuses_the_first_ones_pages_from_l3(tmp_path, ref, layout):
    a, b = _engine(tmp_path, layout), _engine(tmp_path, layout)
    g = torch.Generator().manual_seed(2)
    p = torch.randint(0, 256, (300,), generator=g).tolist()
    out = a.generate([p], SP)[0]
    a.cache.poll(block=True)   # drains the backups and the L3 writes they enqueue
    turn2 = p + out.token_ids + [9] * 30
    got = b.generate([turn2], SP)[0]
    assert got.cached_tokens_by_tier["L3"] >= 16 * ((300 + 7) // 16) - 16
    numerics.assert_same_output(got, ref.generate([turn2], numerics.with_logits(SP))[0], ref.model_config)
    b.check_integrity()
    for e in (a, b):
        e.flush_cache()
        assert e.pools.all_free() and e.cache.host.all_free()
        e.close()


@pytest.mark.numerics
def test_corrupt_l3_objects_are_misses_not_wrong_tokens(tmp_path, ref):
    a = _engine(tmp_path)
    p = [(7 * i) % 256 for i in range(260)]
    a.generate([p], SP)
    a.cache.poll(block=True)   # drains the backups and the L3 writes they enqueue
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if not f.startswith(".")]
    assert files
    for f in files:  # flip a byte in the middle of every stored page
        with open(f, "r+b") as fh:
            fh.seek(os.path.getsize(f) // 2)
            b = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([b[0] ^ 0xFF]))
    b = _engine(tmp_path)
    got = b.generate([p + [1] * 20], SP)[0]
    assert got.cached_tokens_by_tier["L3"] == 0
    numerics.assert_same_output(got, ref.generate([p + [1] * 20], numerics.with_logits(SP))[0], ref.model_config)
    assert b.cache.l3.store.stats()["corrupt"] > 0 or b.cache.l3.stats["read_failures"] > 0
    for e in (a, b):
        e.close()


def test_a_steps_new_prompts_go_to_l2_in_one_copy_and_to_l3_in_one_store_batch(tmp_path, monkeypatch):
    """8 prompts prefilled in one step are backed up together when its commits are done: one L1 -> L2 copy
    per component and one L3 ``batch_set`` per component, not one of each per prompt. Every page ends in
    L2 and L3, the pieces of a node the next prompt's insert split in the same step included."""
    # best_effort: the 8 start at the first schedule or the next, whatever L3's lookups of them take.
    e = _engine(tmp_path, prefetch_policy="best_effort")
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 256, (32,), generator=g).tolist()
    ps = [shared + torch.randint(0, 256, (16,), generator=g).tolist() for _ in range(2)]   # split at page 2
    ps += [torch.randint(0, 256, (48,), generator=g).tolist() for _ in range(6)]
    copies, sets = [], []
    real_copy = transfer.l1_to_l2
    monkeypatch.setattr(transfer, "l1_to_l2", lambda *a, **kw: copies.append(len(a[3])) or real_copy(*a, **kw))
    store = e.cache.l3.store
    real_set = store.batch_set
    monkeypatch.setattr(store, "batch_set", lambda keys, pages: sets.append(len(keys)) or real_set(keys, pages))
    out = e.generate(ps, SamplingParams(max_new_tokens=1, ignore_eos=True))
    e.cache.poll(block=True)
    steps = e.counters["steps"]
    assert steps <= 2 and all(o.cached_tokens == 0 for o in out)
    assert len(copies) == len(sets) == len(e.cache.components) * steps == 2 * steps, (copies, sets)
    nodes = [nd for nd in e.cache.tree.iter_nodes() if nd.parent is not None]
    assert len(nodes) == 9 and e.cache.stats["pages"]["L1->L2"] == sum(copies)
    assert sum(len(nd.l2[FULL]) for nd in nodes) == 8 * 3 - 2   # the shared 2 pages once, in 1 node
    assert all(nd.l2[FULL] is not None and nd.l3[FULL] for nd in nodes)
    kept = [nd for nd in nodes if nd.swa_keep]
    assert kept and all(nd.l2[SWA] is not None and nd.l3[SWA] for nd in kept)
    assert e.cache.l3.stats["written_pages"] == sum(copies) == sum(sets)
    e.check_integrity()
    e.close()
