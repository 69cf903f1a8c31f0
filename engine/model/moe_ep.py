"""Expert parallelism across processes: the all-to-all dispatch over a torch.distributed group, the
per-rank slot weights, and the point-to-point moves of a rebalance.

Layout of one EP group (R ranks, one process each; the process group is handed in from above, by
actors/ep_group.py here):

- **Attention and everything that is not an expert** are replicated: every rank holds those weights and
  its own KV pools, and runs the whole batch (the leader, rank 0, schedules it and broadcasts it; see
  engine/ep.py). In DESIGN terms: one worker = one EP group; attention is data-parallel with a
  data-parallel degree of 1 (each rank computes the same batch), experts are sharded R ways.
- **Experts** are sharded: the layer's P physical slots (engine/model/moe_slots.py) are split into R
  ranks of S = P / R; rank r holds only the weights of slots [r*S, (r+1)*S). Every rank keeps the whole
  mapping (phy2log, log2phy, the round-robin turn), and since every rank routes the same tokens the same
  way, every rank agrees on which slot serves each (token, choice).
- **Dispatch** (``AllToAllDispatch``): rank r takes its shard of the batch (tokens tensor_split into R
  pieces), sends each of its (token, choice) pairs to the rank owning the chosen slot (all_to_all_single:
  first the counts, then the rows with the local slot id packed as an extra column), the owner runs the
  experts on what it received, and a second all_to_all returns the results. Rank r combines its shard's
  pairs in choice order (sum over k of w[t, k] * y[t, k]), so the output does not depend on which replica
  served a choice, and an all_gather gives every rank the full [T, H] again for the replicated attention.
- **Rebalance moves** (``plan_moves`` / ``SlotStager``): only the slots whose expert changes receive
  weights, from a current replica of the new expert (on the same rank when one is there: a local copy;
  else from the replica rank with the fewest sends so far), point to point (isend / irecv) over a SECOND
  process group, from a background thread, into staging buffers, while the serving group keeps
  stepping. ``SlotStager.commit`` then writes the staged rows and switches every layer's mapping; the
  leader announces the commit with a step, so all ranks switch between the same two steps.

Shapes: T tokens, H hidden, K choices per token, S slots per rank, P = R * S slots per layer, L layers.
"""
from __future__ import annotations

import threading
import time
from typing import NamedTuple

import torch
from torch import nn

from engine.model.moe_dispatch import Dispatch
from engine.model.moe_slots import WEIGHTS, _placement


class RankCounters:
    """What this rank's experts did, cumulative, per MoE layer: pairs [L] (token-choice pairs served
    here), compute_s / cpu_s [L] (wall and thread-CPU seconds running the experts on them) and wall_s [L]
    (the whole dispatch, collectives included: the same on every rank, as the slowest rank sets it)."""

    def __init__(self, num_layers: int) -> None:
        self.pairs = [0] * num_layers
        self.compute_s = [0.0] * num_layers
        self.cpu_s = [0.0] * num_layers
        self.wall_s = [0.0] * num_layers


class AllToAllDispatch(Dispatch):
    """Dispatch/combine over ``group`` (gloo on CPU, NCCL on GPU): see the module docstring. ``experts``
    holds this rank's S slots; ``slot`` [T, K] holds global slot ids."""

    name = "all_to_all"

    def __init__(self, group, layer: int, counters: RankCounters) -> None:
        import torch.distributed as dist
        self.dist, self.group, self.layer, self.counters = dist, group, layer, counters
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def __call__(self, x: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor, experts) -> torch.Tensor:
        dist, g, R, r = self.dist, self.group, self.world, self.rank
        t0 = time.perf_counter()
        T, K = slot.shape
        H = x.shape[1]
        S = experts.gate_up_proj.shape[0]
        bounds = [len(c) for c in torch.arange(T).tensor_split(R)]
        lo = sum(bounds[:r])
        n = bounds[r]
        flat = slot[lo:lo + n].reshape(-1)                                 # [n*K] pair -> global slot
        dest = torch.div(flat, S, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)                           # pairs grouped by owner rank
        send_counts = torch.bincount(dest, minlength=R)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=g)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        # The local slot id rides as one more column: exact in any float dtype for S <= 256.
        rows = torch.cat([x[lo:lo + n].repeat_interleave(K, 0)[order],
                          (flat[order] % S).to(x.dtype)[:, None]], 1)     # [n*K, H + 1]
        got = x.new_empty(sum(rc), H + 1)
        dist.all_to_all_single(got, rows, rc, sc, group=g)
        c0, p0 = time.perf_counter(), time.thread_time()
        y = self._experts(got[:, :H], got[:, H].to(torch.int64), experts)
        c1, p1 = time.perf_counter(), time.thread_time()
        back = x.new_empty(n * K, H)
        dist.all_to_all_single(back, y, sc, rc, group=g)
        picked = torch.empty_like(back)
        picked[order] = back                                               # back to pair order
        w = weight[lo:lo + n].to(picked.dtype)
        mine = (picked.view(n, K, H) * w[..., None]).sum(1).to(x.dtype)    # combine in choice order
        # Counted before the last collective: once the leader's gather returns, every rank's count for
        # this layer is in, so a reading taken right after the leader's step sees the whole step.
        c = self.counters
        c.pairs[self.layer] += y.shape[0]
        c.compute_s[self.layer] += c1 - c0
        c.cpu_s[self.layer] += p1 - p0
        full = self._gather(mine, bounds)
        c.wall_s[self.layer] += time.perf_counter() - t0
        return full

    @staticmethod
    def _experts(rows: torch.Tensor, local: torch.Tensor, experts) -> torch.Tensor:
        """rows [m, H] each for local slot local[m] -> [m, H]; each slot runs once on its rows."""
        out = torch.empty_like(rows)
        if rows.shape[0] == 0:
            return out
        order = torch.argsort(local, stable=True)
        counts = torch.bincount(local, minlength=experts.gate_up_proj.shape[0]).tolist()
        start = 0
        for s, k in enumerate(counts):
            if k:
                idx = order[start:start + k]
                out[idx] = experts.expert(s, rows[idx]).to(rows.dtype)
                start += k
        return out

    def _gather(self, mine: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        """Every rank's combined shard -> the whole [T, H] on every rank (shards padded to one size)."""
        m = max(bounds)
        pad = mine.new_zeros(m, mine.shape[1])
        pad[:mine.shape[0]] = mine
        parts = [torch.empty_like(pad) for _ in bounds]
        self.dist.all_gather(parts, pad, group=self.group)
        return torch.cat([p[:b] for p, b in zip(parts, bounds)], 0)


class ShardGather(Dispatch):
    """Another cross-process dispatch (DeepEP's) under replicated attention: each rank hands the inner
    dispatch only its shard of the batch's tokens (so no pair is computed R times) and all_gathers the
    combined shards. ``counters`` gets the pairs this rank sent (DeepEP does not report what it received)."""

    def __init__(self, inner: Dispatch, group, layer: int, counters: RankCounters) -> None:
        import torch.distributed as dist
        self.inner, self.dist, self.group, self.layer, self.counters = inner, dist, group, layer, counters
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.name = f"{inner.name}+shard"

    def __call__(self, x, slot, weight, experts):
        t0 = time.perf_counter()
        bounds = [len(c) for c in torch.arange(x.shape[0]).tensor_split(self.world)]
        lo, n = sum(bounds[:self.rank]), bounds[self.rank]
        mine = self.inner(x[lo:lo + n], slot[lo:lo + n], weight[lo:lo + n], experts)
        self.counters.pairs[self.layer] += slot[lo:lo + n].numel()       # before the gather, as above
        full = AllToAllDispatch._gather(self, mine, bounds)
        self.counters.wall_s[self.layer] += time.perf_counter() - t0
        return full


def cross_process_dispatch(backend: str, group, layer: int, counters: RankCounters, num_slots: int,
                           hidden: int) -> Dispatch:
    """The EP group's dispatch for ``backend`` (EplbConfig.dispatch): DeepEP's normal kernels where
    ``deep_ep`` imports and CUDA is up ("auto", "deep_ep"; "deep_ep_ll": the low-latency kernels), else the
    all-to-all over ``group`` (gloo on CPU), which is what runs on this machine."""
    from engine.model.moe_dispatch import DeepEPDispatch, DeepEPLowLatencyDispatch, deep_ep_available, log
    if backend in ("auto", "deep_ep", "deep_ep_ll"):
        ok, why = deep_ep_available()
        if ok:
            inner = DeepEPLowLatencyDispatch(group, num_slots, hidden) if backend == "deep_ep_ll" \
                else DeepEPDispatch(group)
            return ShardGather(inner, group, layer, counters)
        if backend != "auto":
            log.warning("EP dispatch: DeepEP unavailable (%s); using all_to_all over the process group", why)
    return AllToAllDispatch(group, layer, counters)


def keep_local_slots(moe: nn.Module, rank: int, num_ranks: int) -> None:
    """A layer with slot weights [P, ...] (moe_slots.to_slots) keeps only rank ``rank``'s [S, ...]; the
    mapping stays global. (A real deployment would load only these rows; the tiny models here load all.)"""
    P = moe.slots.num_physical
    if P % num_ranks or not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} of {num_ranks} does not split {P} slots")
    S = P // num_ranks
    ex = moe.experts
    with torch.no_grad():
        for name in WEIGHTS:
            w = getattr(ex, name)
            setattr(ex, name, nn.Parameter(w.data[rank * S:(rank + 1) * S].clone(), requires_grad=False))
    ex.num_experts = S


# ------------------------------------------------------------------------------------------------ moves

class Move(NamedTuple):
    """Slot ``dst`` of ``layer`` gets the weights now held by slot ``src`` (global slot ids)."""
    layer: int
    src: int
    dst: int


def plan_moves(current: torch.Tensor, new: torch.Tensor, num_ranks: int) -> list[Move]:
    """The copies that turn placement current [L, P] into new [L, P]: one per slot whose expert changes,
    from a current replica of its new expert; a replica on the destination's own rank when there is one,
    else the replica on the rank that has sent the fewest so far (ties: the lowest slot). Deterministic,
    so every rank computes the same plan."""
    if current.shape != new.shape or current.dim() != 2 or current.shape[1] % num_ranks:
        raise ValueError(f"shapes: current {tuple(current.shape)}, new {tuple(new.shape)}, ranks {num_ranks}")
    L, P = current.shape
    S = P // num_ranks
    sent = [0] * num_ranks
    moves = []
    for layer in range(L):
        cur, nxt = current[layer].tolist(), new[layer].tolist()
        holders: dict[int, list[int]] = {}
        for s, e in enumerate(cur):
            holders.setdefault(e, []).append(s)
        for dst, e in enumerate(nxt):
            if cur[dst] == e:
                continue
            if e not in holders:
                raise ValueError(f"layer {layer}: expert {e} has no current replica to copy from")
            local = [s for s in holders[e] if s // S == dst // S]
            src = local[0] if local else min(holders[e], key=lambda s: (sent[s // S], s))
            if not local:
                sent[src // S] += 1
            moves.append(Move(layer, src, dst))
    return moves


def _pack(ex, row: int) -> torch.Tensor:
    return torch.cat([getattr(ex, n).data[row].reshape(-1) for n in WEIGHTS])


def _unpack(ex, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    out, at = {}, 0
    for n in WEIGHTS:
        shape = getattr(ex, n).shape[1:]
        k = int(torch.Size(shape).numel())
        out[n] = flat[at:at + k].view(shape)
        at += k
    return out


class SlotStager:
    """One rebalance on one rank: ``start`` runs this rank's part of ``plan_moves`` in a background thread
    (sends from its live slots, which no one writes until the commit; receives into staging buffers) over
    ``group``, a process group used for nothing else; ``commit`` (at a step boundary, the same one on every
    rank) waits for the thread, writes the staged rows into this rank's slots and switches every layer's
    mapping to ``new``. ``bytes_sent`` / ``bytes_received`` / ``seconds`` once done."""

    def __init__(self, moes: list[nn.Module], new: torch.Tensor, rank: int, num_ranks: int, group) -> None:
        cur = torch.stack([m.slots.phy2log for m in moes]).cpu()
        new = torch.as_tensor(new).to(torch.int64).cpu()
        if new.shape != cur.shape:
            raise ValueError(f"phy2log must be {tuple(cur.shape)}, got {tuple(new.shape)}")
        self.placements = [_placement(row, moes[0].slots.num_logical) for row in new]   # validates
        self.moes, self.new, self.rank, self.R, self.group = moes, new, rank, num_ranks, group
        self.moves = plan_moves(cur, new, num_ranks)
        self.S = cur.shape[1] // num_ranks
        self.staged: list[tuple[int, int, torch.Tensor]] = []     # (layer, local dst row, packed weights)
        self.bytes_sent = self.bytes_received = 0
        self.seconds = 0.0
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "SlotStager":
        self._thread = threading.Thread(target=self._run, name=f"ep-stage-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def _run(self) -> None:
        import torch.distributed as dist
        t = time.perf_counter()
        try:
            S, me, works, recvs = self.S, self.rank, [], []
            for i, mv in enumerate(self.moves):
                ex = self.moes[mv.layer].experts
                src_rank, dst_rank = mv.src // S, mv.dst // S
                if src_rank == me and dst_rank == me:
                    self.staged.append((mv.layer, mv.dst % S, _pack(ex, mv.src % S).clone()))
                elif src_rank == me:
                    buf = _pack(ex, mv.src % S).clone()
                    self.bytes_sent += buf.numel() * buf.element_size()
                    works.append(dist.isend(buf, self.group_rank(dst_rank), group=self.group, tag=i))
                elif dst_rank == me:
                    buf = torch.empty_like(_pack(ex, 0))
                    works.append(dist.irecv(buf, self.group_rank(src_rank), group=self.group, tag=i))
                    recvs.append((mv.layer, mv.dst % S, buf))
            for w in works:
                w.wait()
            for layer, row, buf in recvs:
                self.bytes_received += buf.numel() * buf.element_size()
                self.staged.append((layer, row, buf))
        except BaseException as e:  # surfaced by commit()
            self.error = e
        self.seconds = time.perf_counter() - t

    def group_rank(self, rank: int) -> int:
        """The global rank of group rank ``rank`` (isend/irecv take global ranks)."""
        import torch.distributed as dist
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def commit(self) -> int:
        """Waits for the moves, applies them; returns how many slots of this rank changed."""
        if self._thread is None:
            raise RuntimeError("SlotStager.commit before start")
        self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"expert moves failed on rank {self.rank}: {self.error!r}") from self.error
        with torch.no_grad():
            for layer, row, flat in self.staged:
                ex = self.moes[layer].experts
                for name, w in _unpack(ex, flat).items():
                    getattr(ex, name).data[row].copy_(w)
            for moe, p in zip(self.moes, self.placements):
                s = moe.slots
                s.phy2log.copy_(p.phy2log[0])
                s.log2phy.copy_(p.log2phy[0])
                s.logcnt.copy_(p.logcnt[0])
                s.turn.zero_()      # every rank resets it here, so all keep agreeing on the replicas
        return len(self.staged)
