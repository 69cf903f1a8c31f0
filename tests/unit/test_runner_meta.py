"""The one-token (decode) rows of a step's batch metadata: padded page rectangles whose masks mark exactly
the key slots each query may read, whatever the mix of lengths in the batch."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.model.attention import paged_attention
from engine.runner import ModelRunner
from engine.scheduler import ScheduledSeq
from storage.config import KVPoolConfig
from storage.pools import KVPools
from tests.numerics import assert_close

PS = 4


class _Req:
    def __init__(self, n: int) -> None:
        self.seq_len, self.hit, self._ids = n, None, list(range(100, 100 + n))

    def tokens(self, a: int, b: int) -> list[int]:
        return self._ids[a:b]

    def prompt_logprob_positions(self, a: int, b: int) -> list[int]:
        return []


class _Pools:
    class cfg:
        page_size = PS


def _decode(length: int, swa_lo: int, first_page: int) -> ScheduledSeq:
    """The step that computes position ``length - 1`` of a sequence (pages numbered from ``first_page``),
    reading its SWA keys from ``swa_lo``."""
    start = length - 1
    full = list(range(first_page, first_page + -(-length // PS)))
    read = list(range(first_page + 50, first_page + 50 + len(range(swa_lo // PS, -(-start // PS))))) \
        if start > swa_lo else []
    return ScheduledSeq(_Req(length), start, 1, full, swa_lo, read, [(start, 0, start % PS)])


def test_decode_rows_are_padded_and_masked_per_row() -> None:
    seqs = [_decode(9, 3, 0), _decode(1, 0, 10), _decode(14, 6, 20), _decode(5, 4, 30)]
    prefill = ScheduledSeq(_Req(6), 0, 6, [40, 41], 0, [], [])
    ids, meta = ModelRunner(None, _Pools, torch.device("cpu")).build_meta(seqs[:2] + [prefill] + seqs[2:])
    assert ids.tolist() == [108, 100, 100, 101, 102, 103, 104, 105, 113, 104]
    dm = meta.dec
    assert dm.tok.tolist() == [0, 1, 8, 9]   # the prefill's six tokens sit between the second and third
    p_max = max(len(sq.full_pages) for sq in seqs)
    r_max = max(len(sq.swa_read_pages) for sq in seqs)
    assert dm.full_pages.shape == (4, p_max) and dm.swa_pages.shape == (4, r_max)
    assert dm.full_valid.shape == (4, p_max * PS) and dm.swa_valid.shape == (4, r_max * PS)
    for i, sq in enumerate(seqs):
        n, r = len(sq.full_pages), len(sq.swa_read_pages)
        assert dm.full_pages[i].tolist() == sq.full_pages + [0] * (p_max - n)
        assert dm.swa_pages[i].tolist() == sq.swa_read_pages + [0] * (r_max - r)
        # Full attention: every position up to the query's own.
        assert dm.full_valid[i].tolist() == [s < sq.end for s in range(p_max * PS)]
        # Sliding window: the read pages' slots hold positions from the first read page's start on; only
        # those in [swa_lo, start) are keys (the query's own K/V joins them from the batch).
        base = sq.swa_lo - sq.swa_lo % PS
        assert dm.swa_valid[i].tolist() == [sq.swa_lo <= base + s < sq.start for s in range(r_max * PS)]
        # The sliding layers' keys: those slots, then the row's own fresh key.
        assert dm.swa_keys_valid[i].tolist() == dm.swa_valid[i].tolist() + [True]
    assert not dm.all_rows   # the prefill's tokens sit among the rows
    assert len(meta.segs) == 1 and (meta.segs[0].t0, meta.segs[0].t1) == (2, 8)
    assert meta.logit_idx.tolist() == [0, 1, 7, 8, 9]


def test_a_batch_without_any_swa_reads_has_empty_swa_rectangles() -> None:
    seqs = [_decode(1, 0, 0), _decode(2, 1, 5)]
    _, meta = ModelRunner(None, _Pools, torch.device("cpu")).build_meta(seqs)
    dm = meta.dec
    assert dm.swa_pages.shape == (2, 0) and dm.swa_pages.dtype == torch.long
    assert dm.swa_valid.shape == (2, 0)
    assert dm.swa_keys_valid.tolist() == [[True], [True]]
    assert dm.full_valid.tolist() == [[True, False, False, False], [True, True, False, False]]


@pytest.mark.numerics
@pytest.mark.parametrize("sinks", [False, True])
def test_a_batch_of_one_token_rows_alone_attends_as_the_general_path(sinks: bool) -> None:
    """A step of decode rows only (most decode steps) skips the gather of its rows from the batch and the
    scatter back: the same outputs as the general path (within the numerics policy: another layout of
    the same rows may take another kernel) and the same pool contents (copies: equal)."""
    seqs = [_decode(9, 3, 0), _decode(1, 0, 10), _decode(14, 6, 20), _decode(5, 4, 30)]
    _, meta = ModelRunner(None, _Pools, torch.device("cpu")).build_meta(seqs)
    assert meta.dec.all_rows and meta.dec.tok.tolist() == [0, 1, 2, 3]
    general = dataclasses.replace(meta, dec=dataclasses.replace(meta.dec, all_rows=False))
    g = torch.Generator().manual_seed(0)
    hq, hkv, d = 4, 2, 8
    sink = torch.randn(hq, generator=g) if sinks else None
    for window in (None, 8):
        outs, kv = [], []
        for m in (meta, general):
            pools = KVPools(KVPoolConfig(page_size=PS, num_pages=128, swa_full_ratio=1.0),
                            ["sliding_attention", "full_attention"], num_kv_heads=hkv, head_dim=d)
            pool = pools.swa if window else pools.full
            layer = 0 if window else 1
            pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(1)))
            q, k, v = (torch.randn(4, h, d, generator=torch.Generator().manual_seed(2 + i))
                       for i, h in enumerate((hq, hkv, hkv)))
            outs.append(paged_attention(layer, q, k, v, m, pool, sink, d ** -0.5, window))
            kv.append(pool.kv.clone())
        assert outs[0].shape == (4, hq * d)
        # Sums over the keys (scores, then weights . values) and the head dimension.
        keys = max(meta.dec.full_valid.shape[1], meta.dec.swa_keys_valid.shape[1], d)
        assert_close(outs[0], outs[1], n=keys, depth=3, what=f"window {window}")
        assert torch.equal(kv[0], kv[1])
