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
        alone = not segs and len(dec) == t   # one-token rows only, in batch order

        def lt(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=dev)

        waits = [f for sq in seqs if sq.req.hit is not None for f in sq.req.hit.waits if not f.done]
        meta = BatchMeta(segs, lt(pos), lt(fpages), lt(foffs), lt(swa_idx), lt(swa_pages), lt(swa_offs),
                         lt(logit_idx), self._decode_meta(dec, alone) if dec else None, waits)
        return lt(ids), meta

    def _decode_meta(self, dec: list[tuple[int, ScheduledSeq]], alone: bool = False) -> DecodeMeta:
        """Pad the one-token segments' page lists into rectangles; masks mark the real key slots. Built
        from Python lists in one tensor call each: per-row tensors and element writes cost ~70 us a row,
        which was ~10% of a 16-request decode step of a small model on CPU."""
        ps, dev = self.page_size, self.device
        p_max = max(len(sq.full_pages) for _, sq in dec)
        r_max = max(len(sq.swa_read_pages) for _, sq in dec)
        zeros = [0] * max(p_max, r_max)
        full = torch.tensor([[*sq.full_pages, *zeros[:p_max - len(sq.full_pages)]] for _, sq in dec],
                            dtype=torch.long)
        swa = torch.tensor([[*sq.swa_read_pages, *zeros[:r_max - len(sq.swa_read_pages)]] for _, sq in dec],
                           dtype=torch.long).reshape(len(dec), r_max)
        # Per row: the token's index in the batch, its end, its first SWA position, its start.
        tok, ends, lo, start = torch.tensor([[t, sq.end, sq.swa_lo, sq.start] for t, sq in dec],
                                            dtype=torch.long).unbind(1)
        full_valid = torch.arange(p_max * ps)[None, :] < ends[:, None]
        # Positions of the read pages' slots, from the first slot of the first read page.
        rslot = torch.arange(r_max * ps)[None, :] + (lo - lo % ps)[:, None]
        swa_valid = (rslot >= lo[:, None]) & (rslot < start[:, None])
        swa_keys = torch.cat([swa_valid, swa_valid.new_ones(len(dec), 1)], dim=1)
        if dev.type == "cpu":
            return DecodeMeta(tok.contiguous(), full, full_valid, swa, swa_valid, swa_keys, alone)
        return DecodeMeta(tok.to(dev), full.to(dev), full_valid.to(dev), swa.to(dev), swa_valid.to(dev),
                          swa_keys.to(dev), alone)

    def run(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """-> logits [number of sampling segments + len(self.prompt_rows), vocab] fp32: the sampling
        segments' in the order of ``seqs``, then the prompt-logprob rows."""
        ids, meta = self.build_meta(seqs)
        return self.model(ids, meta, self.pools)
