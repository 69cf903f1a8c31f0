"""Runs one scheduled step through the model: flattens the segments into one batch, builds the
paged-attention metadata and returns the next-token logits of the segments that sample."""
from __future__ import annotations

import torch

from engine.model.attention import BatchMeta, DecodeMeta, SegMeta
from engine.model.decoder import CausalLM
from engine.scheduler import ScheduledSeq
from storage.pools import KVPools


class ModelRunner:
    def __init__(self, model: CausalLM, pools: KVPools, device: torch.device) -> None:
        self.model = model
        self.pools = pools
        self.device = device
        self.page_size = pools.cfg.page_size
        # After each run: (request, prompt position) of the logits rows past the sampling ones, for the
        # prompt logprobs a request asked for (the logits at position p score the token at p + 1).
        self.prompt_rows: list = []

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
        dec: list[tuple[int, ScheduledSeq]] = []
        extra: list[int] = []
        self.prompt_rows = []
        t = 0
        for sq in seqs:
            r = sq.req
            ids += r.tokens(sq.start, sq.end)
            positions = range(sq.start, sq.end)
            pos += positions
            fpages += [sq.full_pages[p // ps] for p in positions]
            foffs += [p % ps for p in positions]
            for p, page, off in sq.swa_write:
                swa_idx.append(t + p - sq.start)
                swa_pages.append(page)
                swa_offs.append(off)
            if sq.n == 1:
                dec.append((t, sq))
            else:
                segs.append(SegMeta(t, t + sq.n, sq.start,
                                    torch.tensor(sq.full_pages, dtype=torch.long, device=dev),
                                    sq.swa_lo, torch.tensor(sq.swa_read_pages, dtype=torch.long, device=dev)))
            want = r.prompt_logprob_positions(sq.start, sq.end)
            extra += [t + p - sq.start for p in want]
            self.prompt_rows += [(r, p + 1) for p in want]
            t += sq.n
            if sq.samples:
                logit_idx.append(t - 1)
        logit_idx += extra

        def lt(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=dev)

        waits = [f for sq in seqs if sq.req.hit is not None for f in sq.req.hit.waits if not f.done]
        meta = BatchMeta(segs, lt(pos), lt(fpages), lt(foffs), lt(swa_idx), lt(swa_pages), lt(swa_offs),
                         lt(logit_idx), self._decode_meta(dec) if dec else None, waits)
        return lt(ids), meta

    def _decode_meta(self, dec: list[tuple[int, ScheduledSeq]]) -> DecodeMeta:
        """Pad the one-token segments' page lists into rectangles; masks mark the real key slots."""
        ps, dev = self.page_size, self.device
        b = len(dec)
        p_max = max(len(sq.full_pages) for _, sq in dec)
        r_max = max(len(sq.swa_read_pages) for _, sq in dec)
        full = torch.zeros(b, p_max, dtype=torch.long)
        swa = torch.zeros(b, r_max, dtype=torch.long)
        ends = torch.empty(b, dtype=torch.long)
        lo = torch.empty(b, dtype=torch.long)
        start = torch.empty(b, dtype=torch.long)
        for i, (_, sq) in enumerate(dec):
            full[i, :len(sq.full_pages)] = torch.tensor(sq.full_pages, dtype=torch.long)
            if sq.swa_read_pages:
                swa[i, :len(sq.swa_read_pages)] = torch.tensor(sq.swa_read_pages, dtype=torch.long)
            ends[i], start[i] = sq.end, sq.start
            # Position of the first slot of the first read page.
            lo[i] = sq.swa_lo
        slot = torch.arange(p_max * ps)
        full_valid = slot[None, :] < ends[:, None]
        rslot = torch.arange(r_max * ps)[None, :] + (lo - lo % ps)[:, None]
        swa_valid = (rslot >= lo[:, None]) & (rslot < start[:, None])
        return DecodeMeta(torch.tensor([t for t, _ in dec], dtype=torch.long, device=dev), full.to(dev),
                          full_valid.to(dev), swa.to(dev), swa_valid.to(dev))

    def run(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """-> logits [number of sampling segments + len(self.prompt_rows), vocab] fp32: the sampling
        segments' in the order of ``seqs``, then the prompt-logprob rows."""
        ids, meta = self.build_meta(seqs)
        return self.model(ids, meta, self.pools)
