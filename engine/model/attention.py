"""Attention over paged KV, with the sliding window, and per-head sinks where the model has them
(GPT-OSS).

A forward pass runs a flattened batch of T tokens made of segments, one per request: a prefill chunk
(many tokens) or a decode step (one token). ``BatchMeta`` says where each segment's keys live:

* full layers: the chunk's K/V are written to the full pool first, then each segment reads the
  pages covering positions [0, end).
* sliding layers: each segment reads only the window before its chunk ([lo, start) from the SWA pool)
  and attends to that plus the chunk's fresh K/V; afterwards only the positions later steps still need
  are written. Reads happen before writes within a layer, so the scheduler may hand a page that slides
  out of the window during this step to a position written in this same step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from storage.pools import KVPool


@dataclass
class SegMeta:
    """One request's segment of the batch. Tokens [t0, t1) sit at positions [start, start + t1 - t0)."""

    t0: int
    t1: int
    start: int
    full_pages: torch.Tensor        # [ceil(end / page_size)] pages covering [0, end)
    swa_lo: int                     # first position read from the SWA pool (= max(0, start - W + 1))
    swa_read_pages: torch.Tensor    # pages covering [swa_lo, start), in order

    @property
    def end(self) -> int:
        return self.start + self.t1 - self.t0


@dataclass
class DecodeMeta:
    """All one-token segments of a step, attended in one padded batch of B rows."""

    tok: torch.Tensor               # [B] token index in the flattened batch
    full_pages: torch.Tensor        # [B, P] pages covering [0, end), padded with page 0
    full_valid: torch.Tensor        # [B, P * page_size] key slot holds a position <= the query's
    swa_pages: torch.Tensor         # [B, R] pages covering [swa_lo, start), padded
    swa_valid: torch.Tensor         # [B, R * page_size] key slot holds a position in [swa_lo, start)
    # [B, R * page_size + 1]: swa_valid, then the row's own fresh key (always a key). Built once a step, not
    # in every sliding layer: a small model's step pays each op's few microseconds in every layer.
    swa_keys_valid: torch.Tensor
    all_rows: bool = False          # the batch is these rows alone, in order (tok is arange(B))


@dataclass
class BatchMeta:
    segs: list[SegMeta]             # multi-token segments (prefill chunks)
    positions: torch.Tensor         # [T]
    full_pages: torch.Tensor        # [T] write slot page of each token
    full_offs: torch.Tensor         # [T]
    swa_idx: torch.Tensor           # [Tw] tokens whose K/V are kept in the SWA pool
    swa_pages: torch.Tensor         # [Tw]
    swa_offs: torch.Tensor          # [Tw]
    logit_idx: torch.Tensor         # [B'] tokens whose next-token logits are wanted
    dec: DecodeMeta | None = None
    waits: list = field(default_factory=list)  # LayerFutures of loads into L1 still under way


def _softmax(s: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of scores s [..., m]; a sink [..., 1] joins the normalisation as one
    more logit that attends to nothing."""
    if sink is None:
        return torch.softmax(s, dim=-1)
    logits = torch.cat([s, sink.to(s.dtype)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return torch.softmax(logits, dim=-1)[..., :-1]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor,
            sinks: torch.Tensor | None, scale: float, window: int | None) -> torch.Tensor:
    """q [n, Hq, D], k/v [m, Hkv, D], qpos [n], kpos [m], sinks [Hq] or None -> [n, Hq * D]."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qh = q.reshape(n, hkv, g, d).permute(1, 2, 0, 3)              # [Hkv, G, n, D]
    s = torch.matmul(qh, k.permute(1, 2, 0).unsqueeze(1)) * scale   # [Hkv, G, n, m]
    allowed = kpos[None, :] <= qpos[:, None]
    if window is not None:
        allowed &= kpos[None, :] > qpos[:, None] - window
    s = s.masked_fill(~allowed, float("-inf"))
    p = _softmax(s, None if sinks is None else sinks.reshape(hkv, g, 1, 1).expand(hkv, g, n, 1)).to(v.dtype)
    o = torch.matmul(p, v.permute(1, 0, 2).unsqueeze(1))           # [Hkv, G, n, D]
    return o.permute(2, 0, 1, 3).reshape(n, hq * d)


def _attend_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                    sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
    """One query per row. q [B, Hq, D], k/v [B, M, Hkv, D], valid [B, M] -> [B, Hq * D]."""
    b, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    # matmul rather than einsum: the same batched product (bitwise), without einsum's ~10-20 us of
    # equation parsing and planning per call, which a small model's decode step pays in every layer.
    s = torch.matmul(q.reshape(b, hkv, g, d), k.permute(0, 2, 3, 1)) * scale        # [B, Hkv, G, M]
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = _softmax(s, None if sinks is None else sinks.reshape(1, hkv, g, 1).expand(b, hkv, g, 1)).to(v.dtype)
    return torch.matmul(p, v.permute(0, 2, 1, 3)).reshape(b, hq * d)                 # [B, Hkv, G, D]


def _gather_pages(pool: KVPool, layer: int, pages: torch.Tensor, dtype: torch.dtype):
    """pages [B, P] -> k, v [B, P * page_size, Hkv, D]."""
    kv = pool.kv[pool.layer_slot[layer]]   # [N, 2, ps, H, D]
    b, p = pages.shape
    shape = (b, p * pool.page_size, pool.num_kv_heads, pool.head_dim)
    # K and V each by index_select on its own: gathering [B, P, 2, ps, H, D] by advanced indexing and then
    # splitting it copied every page twice (a gathered page's K or V half is no view of its shape), and
    # index_select is the cheaper gather (2-3x at a decode step's sizes here).
    flat = pages.reshape(-1)
    return (kv[:, 0].index_select(0, flat).reshape(shape).to(dtype),
            kv[:, 1].index_select(0, flat).reshape(shape).to(dtype))


def paged_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: BatchMeta,
                    pool: KVPool, sinks: torch.Tensor | None, scale: float, window: int | None) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] (already rotated) -> [T, Hq * D]."""
    for fut in meta.waits:  # this layer's cached pages may still be arriving from L2
        fut.wait_layer(pool.name, pool.layer_slot[layer])
    dm = meta.dec
    # A batch of one-token rows alone (most decode steps) needs no gather of its rows and no scatter back.
    alone = dm is not None and dm.all_rows
    out = None if alone else torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
    if window is None:
        pool.write(layer, meta.full_pages, meta.full_offs, k, v)
        if dm is not None:
            kk, vv = _gather_pages(pool, layer, dm.full_pages, q.dtype)
            o = _attend_batched(q if alone else q[dm.tok], kk, vv, dm.full_valid, sinks, scale)
            if alone:
                return o
            out[dm.tok] = o
        for sg in meta.segs:
            kk, vv = pool.read(layer, sg.full_pages)
            kk, vv = kk[:sg.end].to(q.dtype), vv[:sg.end].to(q.dtype)
            kpos = torch.arange(sg.end, device=q.device)
            out[sg.t0:sg.t1] = _attend(q[sg.t0:sg.t1], kk, vv, meta.positions[sg.t0:sg.t1], kpos,
                                       sinks, scale, None)
        return out
    for sg in meta.segs:
        n_old = sg.start - sg.swa_lo
        if n_old:
            ko, vo = pool.read(layer, sg.swa_read_pages)
            off = sg.swa_lo % pool.page_size
            kk = torch.cat([ko[off:off + n_old].to(q.dtype), k[sg.t0:sg.t1]])
            vv = torch.cat([vo[off:off + n_old].to(q.dtype), v[sg.t0:sg.t1]])
        else:
            kk, vv = k[sg.t0:sg.t1], v[sg.t0:sg.t1]
        kpos = torch.arange(sg.swa_lo, sg.end, device=q.device)
        out[sg.t0:sg.t1] = _attend(q[sg.t0:sg.t1], kk, vv, meta.positions[sg.t0:sg.t1], kpos,
                                   sinks, scale, window)
    if dm is not None:
        ko, vo = _gather_pages(pool, layer, dm.swa_pages, q.dtype)
        kk = torch.cat([ko, (k if alone else k[dm.tok])[:, None]], dim=1)
        vv = torch.cat([vo, (v if alone else v[dm.tok])[:, None]], dim=1)
        o = _attend_batched(q if alone else q[dm.tok], kk, vv, dm.swa_keys_valid, sinks, scale)
        if alone:
            out = o
        else:
            out[dm.tok] = o
    if meta.swa_idx.numel():
        pool.write(layer, meta.swa_pages, meta.swa_offs, k[meta.swa_idx], v[meta.swa_idx])
    return out
