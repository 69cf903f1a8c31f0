"""L3 through the engine: a prefix one engine wrote is served to another from the shared store with the
same tokens; corrupt or missing objects are misses, never wrong tokens."""
import os

import pytest
import torch

from engine import Engine, SamplingParams
from storage.config import HiCacheConfig
from storage.l3 import L3Config
from tests import numerics

SP = SamplingParams(max_new_tokens=8, ignore_eos=True)


def _engine(path, layout="page_first_direct"):
    return Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256, enable_prefix_cache=True,
                                  poison_kv=True, hicache=HiCacheConfig(host_pages=256, layout=layout,
                                                                        l3=L3Config(backend="file", path=str(path),
                                                                                    prefetch_policy="wait_complete")))


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
