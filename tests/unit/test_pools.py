import pytest

from storage.config import KVPoolConfig
from storage.pools import KVPools, PageAllocator


def test_allocator_integrity_and_errors():
    a = PageAllocator(8, "t")
    pages = a.alloc(5)
    assert pages == [0, 1, 2, 3, 4] and a.num_free == 3
    a.check_integrity({"req": pages})
    with pytest.raises(MemoryError):
        a.alloc(4)
    assert a.num_free == 3
    a.free(pages[:2])
    with pytest.raises(RuntimeError, match="twice"):
        a.free([0])
    with pytest.raises(ValueError, match="range"):
        a.free([99])
    with pytest.raises(AssertionError, match="leaked"):
        a.check_integrity({"req": pages[2:4]})
    with pytest.raises(AssertionError, match="also free"):
        a.check_integrity({"req": pages})
    with pytest.raises(AssertionError, match="owned by both"):
        a.check_integrity({"x": pages[2:], "y": pages[4:]})


def test_pool_shapes_and_roundtrip():
    import torch
    cfg = KVPoolConfig(page_size=4, num_pages=10, swa_full_ratio=0.3)
    pools = KVPools(cfg, ["sliding_attention", "full_attention"] * 2, num_kv_heads=2, head_dim=8)
    assert pools.full.kv.shape == (2, 10, 2, 4, 2, 8)
    assert pools.swa.kv.shape == (2, 3, 2, 4, 2, 8)
    assert pools.full.flat().shape == (2, 10, 128)
    k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    pages = torch.tensor([3, 3, 3, 3, 7, 7])
    offs = torch.tensor([0, 1, 2, 3, 0, 1])
    pools.full.write(1, pages, offs, k, v)
    kk, vv = pools.full.read(1, torch.tensor([3, 7]))
    assert torch.equal(kk[:6], k) and torch.equal(vv[:6], v)


@pytest.mark.parametrize("kw", [dict(page_size=0), dict(num_pages=0), dict(swa_full_ratio=1.5)])
def test_pool_config_validation(kw):
    with pytest.raises(ValueError):
        KVPoolConfig(**kw)
