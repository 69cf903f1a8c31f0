"""Runs one scheduled step through the model: flattens the segments into one batch, builds the
paged-attention metadata and returns the next-token logits of the segments that sample."""
from __future__ import annotations

import torch

from engine.model.attention import BatchMeta, SegMeta
from engine.model.gpt_oss import GptOssForCausalLM
from engine.scheduler import ScheduledSeq
from storage.pools import KVPools


class ModelRunner:
    def __init__(self, model: GptOssForCausalLM, pools: KVPools, device: torch.device) -> None:
        self.model = model
        self.pools = pools
        self.device = device
        self.page_size = pools.cfg.page_size

    def build_meta(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, BatchMeta]:
        ps, dev = self.page_size, self.device
        ids: list[int] = []
        pos: list[int] = []
        fpages: list[int] = []
        foffs: list[int] = []
        swa_idx: list[int] = []
        swa_pages: list[int] = []
        swa_offs: list[int] = []
        logit_idx: list[int] = []
        segs: list[SegMeta] = []
        t = 0
        for sq in seqs:
            r = sq.req
            ids += r.tokens(sq.start, sq.end)
            positions = range(sq.start, sq.end)
            pos += positions
            fpages += [r.full_pages[p // ps] for p in positions]
            foffs += [p % ps for p in positions]
            for p, page, off in sq.swa_write:
                swa_idx.append(t + p - sq.start)
                swa_pages.append(page)
                swa_offs.append(off)
            segs.append(SegMeta(t, t + sq.n, sq.start,
                                torch.tensor(sq.full_pages, dtype=torch.long, device=dev),
                                sq.swa_lo, torch.tensor(sq.swa_read_pages, dtype=torch.long, device=dev)))
            t += sq.n
            if sq.samples:
                logit_idx.append(t - 1)

        def lt(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=dev)

        meta = BatchMeta(segs, lt(pos), lt(fpages), lt(foffs), lt(swa_idx), lt(swa_pages), lt(swa_offs),
                         lt(logit_idx))
        return lt(ids), meta

    def run(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """-> logits [number of sampling segments, vocab] fp32, in the order of ``seqs``."""
        ids, meta = self.build_meta(seqs)
        return self.model(ids, meta, self.pools)
