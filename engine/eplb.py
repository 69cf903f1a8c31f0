"""Expert-parallel load balancing (EPLB): where each expert's replicas live, from observed token counts.

The placement algorithm follows the published description of DeepSeek's EPLB. Redundant physical slots
go one at a time to the expert with the most load per replica (that greedy minimises the largest
per-replica load), then the replicas are packed onto ranks, heaviest first, each into the least-loaded
rank that still has a free slot. With ``num_groups % num_nodes == 0`` the hierarchical policy first packs
whole expert groups onto nodes (group-limited routing then keeps a token's traffic inside few nodes) and
replicates and packs within each node; otherwise the global policy treats everything as one node.

Everything here is pure: tensors and dataclasses in, new ones out, time passed in as an argument. The
EPLB actor owns the schedule and the MoE layers own the weights.

Shapes: L layers, E logical experts, P physical slots (E + redundant), R ranks, P / R slots per rank,
physical slot ``s`` lives on rank ``s // (P / R)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from engine.config import EplbConfig


# ------------------------------------------------------------------------------------- what workers report

class ExpertLoad(NamedTuple):
    """A worker's expert counters as the rebalancer reads them (``expert_load``), cumulative since the worker
    started: logical [L, E] tokens routed to each logical expert, slot_counts [L, P] tokens each physical
    slot served, phy2log [L, P] the placement in force, num_ranks R, steps (forward passes). An EP group's
    reading also carries what its ranks measured: rank_counts [L, R] (token-choice pairs each rank's experts
    served), rank_moe_seconds [R] and rank_moe_cpu_seconds [R] (expert compute, wall and CPU)."""
    logical: torch.Tensor
    slot_counts: torch.Tensor
    phy2log: torch.Tensor
    num_ranks: int
    steps: int
    rank_counts: torch.Tensor | None = None
    rank_moe_seconds: list[float] | None = None
    rank_moe_cpu_seconds: list[float] | None = None


class PlacementApplied(NamedTuple):
    """One worker's switch to a new placement: the slots whose weights changed, and its seconds."""
    moved_slots: int
    seconds: float


# ---------------------------------------------------------------------------------------------- placement

@dataclass(frozen=True, eq=False)
class Placement:
    """phy2log [L, P]: logical expert in each physical slot. log2phy [L, E, P - E + 1]: the slots of
    each logical expert, ascending, padded with -1. logcnt [L, E]: replicas per logical expert.

    log2phy's last dim is the most replicas any expert can have, not the most it has now, so the
    shape is fixed for a given (E, P) and the MoE layer can swap placements into the same buffers."""
    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[1]

    @property
    def num_logical(self) -> int:
        return self.logcnt.shape[1]

    @classmethod
    def from_phy2log(cls, phy2log: torch.Tensor, num_logical: int) -> "Placement":
        """Derives logcnt and log2phy from phy2log [L, P]."""
        phy2log = phy2log.to(torch.int64)
        return cls(phy2log, _log2phy(phy2log, num_logical), _logcnt(phy2log, num_logical))

    def check(self) -> "Placement":
        """Raises ValueError unless the three tensors describe one consistent placement; returns self."""
        p2l, l2p, cnt = self.phy2log, self.log2phy, self.logcnt
        if p2l.dim() != 2 or cnt.dim() != 2 or l2p.dim() != 3:
            raise ValueError(f"placement dims: phy2log {tuple(p2l.shape)}, log2phy {tuple(l2p.shape)}, "
                             f"logcnt {tuple(cnt.shape)}")
        L, P = p2l.shape
        E = cnt.shape[1]
        if cnt.shape[0] != L or l2p.shape != (L, E, P - E + 1):
            raise ValueError(f"placement shapes disagree: phy2log {tuple(p2l.shape)}, log2phy "
                             f"{tuple(l2p.shape)} (want {(L, E, P - E + 1)}), logcnt {tuple(cnt.shape)}")
        if ((p2l < 0) | (p2l >= E)).any():
            raise ValueError("phy2log holds an expert id outside [0, E)")
        if (cnt < 1).any():
            raise ValueError("some logical expert has no replica")
        if not torch.equal(cnt, _logcnt(p2l, E)):
            raise ValueError("logcnt disagrees with the replicas counted in phy2log")
        valid = l2p >= 0
        if not torch.equal(valid.sum(-1), cnt) or (valid[..., 1:] & ~valid[..., :-1]).any():
            raise ValueError("log2phy must hold logcnt slots per expert, then -1 padding")
        if (l2p >= P).any() or (l2p < -1).any():
            raise ValueError("log2phy holds a slot outside [0, P)")
        lay = torch.arange(L).view(L, 1, 1).expand_as(l2p)
        owner = p2l[lay[valid], l2p[valid]]
        expert = torch.arange(E).view(1, E, 1).expand_as(l2p)[valid]
        if not torch.equal(owner, expert):
            raise ValueError("log2phy points at a slot phy2log gives to another expert")
        # With the counts above equal, each slot named exactly once means log2phy is phy2log inverted.
        hits = torch.bincount(lay[valid] * P + l2p[valid], minlength=L * P)
        if not (hits == 1).all():
            raise ValueError("log2phy names some physical slot twice or never")
        return self


def identity_placement(num_layers: int, num_logical: int, num_ranks: int, redundant_per_rank: int = 0
                       ) -> Placement:
    """The placement before any load is known: rank r holds logical experts [r*E/R, (r+1)*E/R) in order,
    then ``redundant_per_rank`` slots; redundant slot j (counted over all ranks) replicates expert j % E."""
    for name, v, lo in (("num_layers", num_layers, 1), ("num_logical", num_logical, 1),
                        ("num_ranks", num_ranks, 1), ("redundant_per_rank", redundant_per_rank, 0)):
        if v < lo:
            raise ValueError(f"{name} must be >= {lo}, got {v}")
    if num_logical % num_ranks:
        raise ValueError(f"num_logical ({num_logical}) must be a multiple of num_ranks ({num_ranks})")
    own = torch.arange(num_logical).view(num_ranks, -1)
    extra = (torch.arange(num_ranks * redundant_per_rank) % num_logical).view(num_ranks, -1)
    row = torch.cat([own, extra], dim=1).flatten()
    return Placement.from_phy2log(row.expand(num_layers, -1).contiguous(), num_logical)


def _logcnt(phy2log: torch.Tensor, E: int) -> torch.Tensor:
    """phy2log [L, P] -> replicas per expert [L, E]."""
    return torch.zeros(phy2log.shape[0], E, dtype=torch.int64).scatter_add_(
        1, phy2log, torch.ones_like(phy2log))


def _log2phy(phy2log: torch.Tensor, E: int) -> torch.Tensor:
    """phy2log [L, P] -> log2phy [L, E, P - E + 1], each expert's slots ascending, -1 padded."""
    L, P = phy2log.shape
    # A stable sort by expert id lists each expert's slots in ascending slot order, experts in a row.
    order = torch.sort(phy2log, dim=1, stable=True).indices           # [L, P] slots grouped by expert
    sorted_e = phy2log.gather(1, order)
    cnt = _logcnt(phy2log, E)
    start = torch.cumsum(cnt, 1) - cnt                                 # [L, E] first position of each
    rank = torch.arange(P).view(1, P) - start.gather(1, sorted_e)      # replica index within its expert
    out = torch.full((L, E, P - E + 1), -1, dtype=torch.int64)
    out[torch.arange(L).view(L, 1).expand(L, P), sorted_e, rank] = order
    return out


# ---------------------------------------------------------------------------------------------- algorithm

def _balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [X, n] -> (pack [X, n], position in pack [X, n]); every pack gets n / num_packs items.

    Heaviest item first into the lightest pack that still has room (LPT with a cardinality limit).
    Rows are independent and done together, so the Python loop runs n times, not X * n."""
    X, n = weight.shape
    cap = n // num_packs
    order = torch.sort(weight, dim=1, descending=True, stable=True).indices
    pack_w = torch.zeros(X, num_packs, dtype=weight.dtype)
    pack_n = torch.zeros(X, num_packs, dtype=torch.int64)
    pack = torch.empty(X, n, dtype=torch.int64)
    pos = torch.empty(X, n, dtype=torch.int64)
    rows = torch.arange(X)
    inf = torch.tensor(float("inf"), dtype=weight.dtype)
    for i in range(n):
        item = order[:, i]
        p = torch.where(pack_n < cap, pack_w, inf).argmin(1)          # first lightest: deterministic
        pack[rows, item] = p
        pos[rows, item] = pack_n[rows, p]
        pack_w[rows, p] += weight[rows, item]
        pack_n[rows, p] += 1
    return pack, pos


def _replicate(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [X, m] -> (phy2log [X, num_phy], logcnt [X, m]). Slot i < m holds expert i; each further
    slot replicates the expert with the largest load per replica (first one on ties)."""
    X, m = weight.shape
    phy2log = torch.cat([torch.arange(m).expand(X, m), torch.empty(X, num_phy - m, dtype=torch.int64)], 1)
    cnt = torch.ones(X, m, dtype=torch.int64)
    rows = torch.arange(X)
    for i in range(m, num_phy):
        hot = (weight / cnt).argmax(1)
        phy2log[:, i] = hot
        cnt[rows, hot] += 1
    return phy2log, cnt


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """perm [X, n] (a permutation per row) -> its inverse [X, n]."""
    return torch.empty_like(perm).scatter_(1, perm, torch.arange(perm.shape[1]).expand_as(perm).contiguous())


def _hierarchical(w: torch.Tensor, P: int, G: int, N: int, R: int) -> torch.Tensor:
    """w [L, E] float64 -> phy2log [L, P]: groups onto nodes, replicas within nodes, replicas onto ranks."""
    L, E = w.shape
    gs, epn = E // G, E // N                                           # experts per group / per node
    gpack, gpos = _balanced_packing(w.view(L, G, gs).sum(-1), N)       # [L, G]
    # "Node-major" ids: node n's experts are [n*E/N, (n+1)*E/N), so each node is a contiguous slice.
    log2mlog = (((gpack * (G // N) + gpos) * gs).unsqueeze(-1) + torch.arange(gs)).flatten(1)  # [L, E]
    mlog2log = _inverse(log2mlog)
    w_node = w.gather(1, mlog2log).view(L * N, epn)                    # [L*N, E/N]
    phy2mlog, mlogcnt = _replicate(w_node, P // N)                     # [L*N, P/N], [L*N, E/N]
    per_replica = (w_node / mlogcnt).gather(1, phy2mlog)               # [L*N, P/N]
    rank, pos = _balanced_packing(per_replica, R // N)                 # ranks local to the node
    slot = _inverse(rank * (P // R) + pos)                             # node-local slot -> replica
    mlog = phy2mlog.gather(1, slot).view(L, N, P // N) + (torch.arange(N) * epn).view(1, N, 1)
    return mlog2log.gather(1, mlog.flatten(1))


def _check_ints(**kw: int) -> None:
    for name, v in kw.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")


def _as_load(weight: torch.Tensor) -> torch.Tensor:
    """Validates a load tensor [L, E] and returns it as float64 on the CPU."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or 0 in weight.shape:
        raise ValueError(f"weight must be a non-empty [layers, logical_experts] tensor, got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    w = weight.detach().to("cpu", torch.float64)
    if not torch.isfinite(w).all():
        raise ValueError("weight holds NaN or inf")
    if (w < 0).any():
        raise ValueError("weight holds negative loads")
    return w


def rebalance(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_ranks: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [L, E] (token counts per logical expert) -> (phy2log [L, P], log2phy [L, E, P - E + 1]
    padded with -1, logcnt [L, E]), P = num_replicas, int64 on the CPU. Deterministic.

    Hierarchical when num_groups % num_nodes == 0 (then num_groups must divide E and num_nodes must
    divide num_ranks), global otherwise. Needs P >= E and num_ranks | P."""
    w = _as_load(weight)
    _check_ints(num_replicas=num_replicas, num_groups=num_groups, num_nodes=num_nodes, num_ranks=num_ranks)
    L, E = w.shape
    P = num_replicas
    if P < E:
        raise ValueError(f"num_replicas ({P}) < logical experts ({E})")
    if P % num_ranks:
        raise ValueError(f"num_replicas ({P}) must be a multiple of num_ranks ({num_ranks})")
    if num_groups % num_nodes == 0:
        if E % num_groups:
            raise ValueError(f"num_groups ({num_groups}) must divide the logical experts ({E})")
        if num_ranks % num_nodes:
            raise ValueError(f"num_nodes ({num_nodes}) must divide num_ranks ({num_ranks})")
        phy2log = _hierarchical(w, P, num_groups, num_nodes, num_ranks)
    else:
        phy2log = _hierarchical(w, P, 1, 1, num_ranks)
    return phy2log, _log2phy(phy2log, E), _logcnt(phy2log, E)


def rebalance_placement(weight: torch.Tensor, cfg: EplbConfig) -> Placement:
    """``rebalance`` with the knobs of ``cfg``, as a Placement."""
    p = rebalance(weight, cfg.num_replicas(weight.shape[-1]), cfg.num_groups, cfg.num_nodes, cfg.num_ranks)
    return Placement(*p)


def align_placement(current: torch.Tensor, new: torch.Tensor, num_ranks: int, num_nodes: int = 1
                    ) -> torch.Tensor:
    """The migration-aware placement: new phy2log [L, P] relabelled to move as few expert weights as
    possible from current [L, P]. Nodes are matched first (the pair sharing the most experts first), then
    the ranks within each matched pair of nodes, and, within a rank, a slot keeps its expert whenever the
    new rank holds that expert too. Every rank's multiset of experts is one of ``new``'s, so rank loads
    (hence balancedness) are exactly those of ``new``, and a node keeps whole expert groups when ``new``
    did (ranks never change node)."""
    if current.shape != new.shape or current.dim() != 2 or current.shape[1] % num_ranks or num_ranks % num_nodes:
        raise ValueError(f"shapes: current {tuple(current.shape)}, new {tuple(new.shape)}, ranks {num_ranks}, "
                         f"nodes {num_nodes}")
    L, P = new.shape
    S, E, rpn = P // num_ranks, int(max(current.max(), new.max())) + 1, num_ranks // num_nodes
    out = torch.empty_like(new)

    def hist(rows: torch.Tensor) -> torch.Tensor:
        return torch.zeros(rows.shape[0], E, dtype=torch.int64).scatter_add_(1, rows, torch.ones_like(rows))

    def match(overlap: torch.Tensor) -> list[int]:
        """overlap [cur, new] -> new j -> cur target[j], greedily by the largest overlap."""
        n = overlap.shape[0]
        overlap, target = overlap.clone(), [0] * n
        for _ in range(n):
            i, j = divmod(int(overlap.argmax()), n)
            target[j] = i
            overlap[i, :], overlap[:, j] = -1, -1
        return target

    for layer in range(L):
        cur_r, new_r = current[layer].view(num_ranks, S), new[layer].view(num_ranks, S)
        hc, hn = hist(cur_r), hist(new_r)
        rank_overlap = torch.minimum(hc[:, None, :], hn[None, :, :]).sum(-1)              # [cur, new]
        node_overlap = torch.minimum(hc.view(num_nodes, rpn, E).sum(1)[:, None, :],
                                     hn.view(num_nodes, rpn, E).sum(1)[None, :, :]).sum(-1)
        target = [0] * num_ranks                         # new rank j -> current rank target[j]
        for nj, ni in enumerate(match(node_overlap)):
            sub = rank_overlap[ni * rpn:(ni + 1) * rpn, nj * rpn:(nj + 1) * rpn]
            for j, i in enumerate(match(sub)):
                target[nj * rpn + j] = ni * rpn + i
        for j in range(num_ranks):
            keep, todo = cur_r[target[j]].tolist(), new_r[j].tolist()
            row = [-1] * S
            for pos, e in enumerate(keep):          # a slot keeps its expert when the new rank has it
                if e in todo:
                    row[pos] = e
                    todo.remove(e)
            for pos in range(S):
                if row[pos] < 0:
                    row[pos] = todo.pop(0)
            out[layer, target[j] * S:(target[j] + 1) * S] = torch.tensor(row, dtype=new.dtype)
    return out


def moved_slots(current: torch.Tensor, new: torch.Tensor) -> int:
    """Slots whose expert changes from current [L, P] to new [L, P]: the weights a rebalance moves."""
    return int((torch.as_tensor(current) != torch.as_tensor(new)).sum())


def rank_loads(weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor, num_ranks: int
               ) -> torch.Tensor:
    """Load per rank [L, R] when each replica takes load / logcnt of its expert's load weight [L, E]."""
    w = _as_load(weight)
    _check_ints(num_ranks=num_ranks)
    L, P = phy2log.shape
    if w.shape != logcnt.shape or w.shape[0] != L or P % num_ranks:
        raise ValueError(f"shapes: weight {tuple(w.shape)}, phy2log {tuple(phy2log.shape)}, logcnt "
                         f"{tuple(logcnt.shape)}, num_ranks {num_ranks}")
    per_replica = (w / logcnt.to(torch.float64)).gather(1, phy2log.to(torch.int64))    # [L, P]
    return per_replica.view(L, num_ranks, P // num_ranks).sum(-1)


def balancedness(weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor, num_ranks: int
                 ) -> torch.Tensor:
    """Mean rank load / max rank load per layer [L] (float64; 1.0 is perfect, a layer with no load
    counts as 1.0)."""
    loads = rank_loads(weight, phy2log, logcnt, num_ranks)
    mx = loads.max(1).values
    return torch.where(mx > 0, loads.mean(1) / mx.clamp_min(1e-300), torch.ones_like(mx))


def should_rebalance(current_balancedness, new_balancedness, threshold: float) -> bool:
    """Apply a new placement only when the current one is under ``threshold`` and the new one is better.
    Per-layer tensors [L] are averaged first (one placement swap covers all layers)."""
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
    cur, new = (float(torch.as_tensor(b, dtype=torch.float64).mean()) for b in
                (current_balancedness, new_balancedness))
    return cur < threshold and new > cur


# ------------------------------------------------------------------------------------------------- window

@dataclass(frozen=True, eq=False)
class LoadWindow:
    """The loads of the last ``window`` intervals: ``push`` returns a new window, this one is unchanged.
    entries: (time, counts [L, E] int64) oldest first; time is the caller's clock, only kept for
    reporting (``span``)."""
    window: int
    entries: tuple[tuple[float, torch.Tensor], ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"LoadWindow.window must be an int >= 1, got {self.window!r}")

    def __len__(self) -> int:
        return len(self.entries)

    def push(self, counts: torch.Tensor, now: float) -> "LoadWindow":
        """Adds one interval's counts [L, E] observed at ``now``; drops intervals beyond the window."""
        c = _as_load(counts).to(torch.int64)   # a copy: the caller's live counter keeps counting
        if self.entries:
            if c.shape != self.entries[-1][1].shape:
                raise ValueError(f"counts shape {tuple(c.shape)} != window's {tuple(self.entries[-1][1].shape)}")
            if now < self.entries[-1][0]:
                raise ValueError(f"time went backwards: {now} < {self.entries[-1][0]}")
        return LoadWindow(self.window, (self.entries + ((float(now), c),))[-self.window:])

    def total(self) -> torch.Tensor:
        """Sum of the counts in the window [L, E]."""
        if not self.entries:
            raise ValueError("LoadWindow is empty")
        return torch.stack([c for _, c in self.entries]).sum(0)

    def span(self) -> tuple[float, float]:
        """(oldest, newest) push time in the window."""
        if not self.entries:
            raise ValueError("LoadWindow is empty")
        return self.entries[0][0], self.entries[-1][0]


def interval_counts(previous: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """Per-interval counts [L, E] from two reads of a cumulative counter (MoE.expert_counts). If any
    count went down the counters were reset (worker restart), so the current read is all they counted
    since; a per-element test would miss the counters that already climbed past their old value."""
    if previous.shape != current.shape:
        raise ValueError(f"counter shapes differ: {tuple(previous.shape)} vs {tuple(current.shape)}")
    d = current.to(torch.int64) - previous.to(torch.int64)
    return current.to(torch.int64).clone() if (d < 0).any() else d
