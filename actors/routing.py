"""The global prefix index and the route policy (pure: no Ray; the router actor holds one of these).

Workers publish their trees' KV events on the field's wire (storage/kv_events/: BlockStored / BlockRemoved
per medium and KV-cache group); the shared L3 store publishes its writes and evictions the same way, as
the holder ``L3``. The index keys pages by the wire's block id (``block_hash``: a u64 from the page key)
and answers, per prefill worker, how much of a prompt that worker could serve from cache: full pages it
holds in L1/L2 or L3 has, usable only up to a point where the last window of SWA pages is also held (by
the worker or L3) -- the rule of the worker's own radix tree.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from engine.worker_load import WorkerLoad
from storage.geometry import KVGeometry
from storage.hashing import DEFAULT_SEED, page_ids, page_keys
from storage.kv_events.translate import FULL_GROUP, SLIDING_GROUP
from storage.kv_events.wire import AllBlocksCleared, BlockStored

L3_WORKER = "L3"
TIER_RANK = {"L1": 0, "L2": 1, "L3": 2}
ROUTE_POLICIES = ("prefix", "round_robin")


@dataclass(frozen=True)
class RouterConfig:
    """Route = argmin over prefill workers of
    ``miss_weight * uncached tokens + sum(tier_weight[t] * tokens served from t) + load_weight * queued``.
    ``policy: round_robin`` ignores the cache and load and takes the workers in turn (a baseline for
    benchmarks: what prefix-aware routing is compared against).
    """

    seed: bytes | str | int = DEFAULT_SEED
    miss_weight: float = 1.0
    l1_weight: float = 0.0
    l2_weight: float = 0.1
    l3_weight: float = 0.3
    # per queued prefill token of the worker. Measured (bench/routing.py, 2 prefill workers, concurrent
    # multi-turn clients): 0 -> hit 0.684, TTFT 113 ms (piles onto one worker); 0.25 -> 0.684, 88 ms;
    # 1 -> 0.617, 88 ms; 4 -> 0.585, 89 ms; round-robin 0.438, 111 ms. A queued token delays a turn less
    # than a recomputed one costs it: it overlaps with the decode of others and shares batches.
    load_weight: float = 0.25
    running_weight: float = 16.0     # per running request of the worker
    policy: str = "prefix"           # prefix | round_robin
    # A routed prompt counts as held by its worker (in L1) until this many of the worker's reports came
    # since (actors/recent_routes.py): its KV events come with them, so a repeat sooner would otherwise go
    # elsewhere. 0: the index alone.
    recent_reports: int = 2
    # Conditional disaggregation (Dynamo's: "if the prefill is short or the decode engine has a high prefix
    # cache hit, it is more efficient to prefill locally in the decode engine"; llm-d decides on the same
    # count): a request with a decode phase whose prompt its decode worker holds itself (L1/L2) but for at
    # most this many tokens is prefilled there, with no handoff, no lease and no transfer. A multi-turn
    # conversation's next turn finds its history on the decode worker that ran the last one. 0: every such
    # request is handed off.
    local_prefill_tokens: int = 128

    def __post_init__(self) -> None:
        if self.policy not in ROUTE_POLICIES:
            raise ValueError(f"policy must be one of {ROUTE_POLICIES}, got {self.policy!r}")
        for name in ("miss_weight", "l1_weight", "l2_weight", "l3_weight", "load_weight", "running_weight"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        if isinstance(self.recent_reports, bool) or not isinstance(self.recent_reports, int) or self.recent_reports < 0:
            raise ValueError(f"recent_reports must be an integer >= 0, got {self.recent_reports!r}")
        if isinstance(self.local_prefill_tokens, bool) or not isinstance(self.local_prefill_tokens, int) \
                or self.local_prefill_tokens < 0:
            raise ValueError(f"local_prefill_tokens must be an integer >= 0, got {self.local_prefill_tokens!r}")


@dataclass
class Overlap:
    pages: int = 0
    by_tier: dict[str, int] = field(default_factory=lambda: {"L1": 0, "L2": 0, "L3": 0})


class PrefixIndex:
    """block id -> holder -> tiers, separately for the full and the SWA component. A block id is the wire's
    (storage/kv_events/translate.block_hash: the first 8 bytes of the page key as a u64).

    Stored compact: each holder gets a slot number on first sight (``_slots``; never reused, so a bit
    never changes meaning; the shared L3 store is slot 0 from the start), and a page's value is one int
    whose bit ``3 * slot + rank`` (rank: L1 0, L2 1, L3 2) says that holder holds the page in that tier.
    ``_full`` / ``_swa``: block id -> that int (never 0: a page nobody holds is not in the table). One
    dict lookup per page gives every holder's tiers (the old dict of dict of set took ~700 B and a chain
    of dependent cache misses per page). There is no per-holder key set: ``drop_worker`` and ``blocks``
    scan the tables, and they are rare (a worker's death, a flush (``AllBlocksCleared``), a snapshot, an
    audit), while every routed prompt and every event would pay for keeping one."""

    def __init__(self) -> None:
        self._slots: dict[str, int] = {L3_WORKER: 0}
        self._full: dict[int, int] = {}
        self._swa: dict[int, int] = {}
        # one int object per distinct mask (a handful in practice): the tables share them, so a page costs
        # no value object of its own and a walk reads values that stay in cache. Cleared when it grows
        # past _MASKS_MAX (the tables keep working; only the sharing is lost until values repeat again).
        self._masks: dict[int, int] = {}
        # slots that stored a page since their last drop: dropping any other holder is a no-op, not a
        # scan (a fresh report and the forget that follows it each drop the same worker)
        self._stored: set[int] = set()

    def __len__(self) -> int:
        return len(self._full)

    def apply(self, worker: str, events: Iterable) -> None:
        """Apply a tree's KV events (storage/radix/node.KVEvent: page keys, tier, component)."""
        for ev in events:
            self._change(worker, ev.kind == "stored", ev.tier, ev.component == "full",
                         [int.from_bytes(k[:8], "big") for k in ev.page_keys])

    def apply_wire(self, holder: str, events: Iterable, tiers: Mapping[str, str]) -> int:
        """Apply wire events (storage/kv_events/wire.py) of one publisher; ``tiers``: medium -> tier
        (media not named are skipped, as are groups other than full (0) and sliding (1)). An
        ``AllBlocksCleared`` forgets everything ``holder`` held. Returns the events applied."""
        n = 0
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.drop_worker(holder)
                n += 1
                continue
            tier = tiers.get(ev.medium)
            group = ev.group_idx or 0
            if tier is None or group not in (FULL_GROUP, SLIDING_GROUP):
                continue
            hashes = ev.block_hashes
            if hashes and not isinstance(hashes[0], int):   # a producer sending bytes
                hashes = [int.from_bytes(bytes(h)[:8], "big") for h in hashes]
            self._change(holder, isinstance(ev, BlockStored), tier, group == FULL_GROUP, hashes)
            n += 1
        return n

    def _change(self, worker: str, stored: bool, tier: str, full: bool, blocks: Iterable[int]) -> None:
        rank = TIER_RANK.get(tier)
        if rank is None:
            raise ValueError(f"tier must be one of {tuple(TIER_RANK)}, got {tier!r}")
        table = self._full if full else self._swa
        slot = self._slots.get(worker)
        if slot is None:
            if not stored:
                return            # it never stored anything: nothing to remove
            slot = self._slots[worker] = len(self._slots)
        bit = 1 << (3 * slot + rank)
        if stored:
            self._stored.add(slot)
        get, masks = table.get, self._masks
        if len(masks) > _MASKS_MAX:
            masks.clear()
        share = masks.setdefault
        if stored:
            for key in blocks:
                v = get(key, 0) | bit
                table[key] = share(v, v)
            return
        for key in blocks:
            v = get(key)
            if v is not None and v & bit:
                v ^= bit
                if v:
                    table[key] = share(v, v)
                else:
                    del table[key]

    def blocks(self, worker: str, tier: str | None = None, full: bool = True) -> set[int]:
        """The block ids ``worker`` holds (in ``tier``, or any), of the full or the SWA component. Scans
        the table (rare: snapshots and audits)."""
        slot = self._slots.get(worker)
        if slot is None or (tier is not None and tier not in TIER_RANK):
            return set()
        mask = (1 << (3 * slot + TIER_RANK[tier])) if tier is not None else (7 << (3 * slot))
        return {k for k, v in (self._full if full else self._swa).items() if v & mask}

    def drop_worker(self, worker: str) -> int:
        """Forget everything a (dead or flushed) worker held; returns how many distinct block ids it held
        (in either table). Scans both tables (rare: a worker's death, a flush). The worker keeps its
        slot (a slot is never reused)."""
        slot = self._slots.get(worker)
        if slot not in self._stored:
            return 0
        self._stored.discard(slot)
        mask = 7 << (3 * slot)
        keep = ~mask
        held: set[int] = set()
        for table in (self._full, self._swa):
            mine = [(k, v) for k, v in table.items() if v & mask]
            held.update(k for k, _ in mine)
            for k, v in mine:
                v &= keep
                if v:
                    table[k] = self._masks.setdefault(v, v)
                else:
                    del table[k]
        return len(held)

    def overlap(self, keys: Sequence[int], worker: str, window_pages: int) -> Overlap:
        """Usable cached prefix of ``keys`` for ``worker`` (see the module doc)."""
        return self.overlap_all(keys, [worker], window_pages)[worker]

    def overlap_all(self, keys: Sequence[int], workers: list[str], window_pages: int) -> dict[str, Overlap]:
        """``overlap`` for several workers. Each key is looked up once in the full table up to the first
        page nobody holds (no worker's prefix goes past it), then each worker walks the looked-up masks
        (``_walk``; compiled in actors/_routing.c where it built, the same answers)."""
        return {w: Overlap(p, {"L1": a, "L2": b, "L3": c})
                for w, (p, a, b, c) in zip(workers, self._overlap_rows(keys, workers, window_pages))}

    def own_overlap(self, keys: Sequence[int], worker: str, window_pages: int) -> Overlap:
        """``overlap`` from what ``worker`` holds itself (its L1/L2), the shared L3 store left out."""
        (p, a, b, c), = self._overlap_rows(keys, [worker], window_pages, shared_l3=False)
        return Overlap(p, {"L1": a, "L2": b, "L3": c})

    def _overlap_rows(self, keys: Sequence[int], workers: Sequence[str], window_pages: int,
                      shared_l3: bool = True) -> list[tuple[int, int, int, int]]:
        """``overlap_all``'s answers as ``(pages, L1, L2, L3)`` per worker, in ``workers`` order (what
        ``route`` reads: no Overlap built for the workers it does not pick). ``shared_l3``: the shared L3
        store's pages serve every worker."""
        swa = self._swa if window_pages else None
        slots = self._slots
        shifts = [3 * s if (s := slots.get(w)) is not None else -1 for w in workers]
        if _c_overlap is not None:
            got = _c_overlap(self._full, swa, keys if type(keys) is list else list(keys), shifts,
                             3 * slots[L3_WORKER] if shared_l3 else -1, window_pages)
            if got is not None:   # None: something only the Python walk judges
                return got
        fulls = list(map(self._full.get, keys))
        if None in fulls:
            del fulls[fulls.index(None):]
        l3_bit = _L3_BIT if shared_l3 else 0
        return [_walk(fulls, keys, swa, s, window_pages, l3_bit) for s in shifts]


try:
    from actors._routing import overlap as _c_overlap   # the same walk compiled (actors/_routing.c)
except ImportError:   # built without a C compiler: the Python walk below, slower on a large index
    _c_overlap = None

_MASKS_MAX = 1 << 12
_L3_BIT = 1 << 2    # the shared L3 store (slot 0) holds the page in tier L3


def _walk(fulls: list[int], keys: Sequence[int], swa: dict | None, shift: int,
          window_pages: int, l3_bit: int = _L3_BIT) -> tuple[int, int, int, int]:
    """The usable prefix ``(pages, L1, L2, L3)`` for one worker (see the module doc for the rule) over the
    looked-up full masks ``fulls`` of ``keys``; ``shift``: 3 * the worker's slot (-1: a worker the index
    never saw). The worker's full pages run up to its first page held neither by it nor by L3; the prefix
    is usable up to the end of the last run of SWA pages (in ``swa``: the worker's or L3's) inside it that
    is ``window_pages`` long or starts at page 0 (``swa`` None: no window to check). Each page is served
    from the fastest tier the worker holds it in, else from L3."""
    usable = (l3_bit | (7 << shift)) if shift >= 0 else l3_bit
    n = 0
    for v in fulls:
        if not v & usable:
            break
        n += 1
    best = n
    if swa is not None:
        # the last SWA run that counts: scan down from the end of the full prefix, run by run
        best, i, get = 0, n - 1, swa.get
        while i >= 0:
            while i >= 0 and not get(keys[i], 0) & usable:
                i -= 1
            end = i
            while i >= 0 and get(keys[i], 0) & usable:
                i -= 1
            if end >= 0 and (i < 0 or end - i >= window_pages):
                best = end + 1
                break
    count = [0, 0, 0]
    for v in fulls[:best]:
        t = (v >> shift) & 7 if shift >= 0 else 0
        count[0 if t & 1 else 1 if t & 2 else 2] += 1
    return best, count[0], count[1], count[2]


class NoWorkerError(ValueError):
    """No live worker of the role a request needs: transient after a router restart (workers re-report
    every interval), so callers may wait and ask again."""


def prompt_keys(tokens: Sequence[int], geom: KVGeometry, cfg: RouterConfig) -> list[bytes]:
    """The page keys of the prompt's cacheable pages (the engine's hashing: same page size and seed)."""
    return page_keys(list(tokens[:geom.cacheable_tokens(len(tokens))]), geom.page_size, seed=cfg.seed)


def prompt_blocks(tokens: Sequence[int], geom: KVGeometry, cfg: RouterConfig) -> list[int]:
    """The wire's block ids of the prompt's cacheable pages: what the index is keyed by (the first 8
    bytes of each ``prompt_keys`` key, big-endian; computed without the keys, storage/hashing.page_ids)."""
    return page_ids(tokens, geom.page_size, seed=cfg.seed,
                    num_pages=geom.cacheable_tokens(len(tokens)) // geom.page_size)


def route(index: PrefixIndex, keys: Sequence[int], prompt_len: int, loads: Mapping[str, WorkerLoad],
          cfg: RouterConfig, geom: KVGeometry, turn: int = 0,
          recent: Mapping[str, int] | None = None) -> tuple[str, Overlap]:
    """The prefill worker with the lowest cost for this prompt (ties: the first in ``loads`` order).
    ``recent``: per worker, the leading pages of ``keys`` just routed to it (RecentRoutes), counted as L1
    where the index holds fewer. ``round_robin``: the ``turn``-th worker of ``loads`` (the caller counts
    its decisions)."""
    if not loads:
        raise NoWorkerError("no prefill worker is available")
    if cfg.policy == "round_robin":
        worker = list(loads)[turn % len(loads)]
        return worker, index.overlap(keys, worker, geom.window_pages)
    workers = list(loads)
    if isinstance(index, PrefixIndex):
        rows = index._overlap_rows(keys, workers, geom.window_pages)
    else:
        rows = [(o.pages, o.by_tier["L1"], o.by_tier["L2"], o.by_tier["L3"])
                for o in map(index.overlap_all(keys, workers, geom.window_pages).__getitem__, workers)]
    ps = geom.page_size
    best = None
    for (worker, load), (pages, l1, l2, l3) in zip(loads.items(), rows):
        if recent and recent.get(worker, 0) > pages:
            pages, l1 = recent[worker], l1 + recent[worker] - pages
        cost = (cfg.miss_weight * (prompt_len - pages * ps)
                + ps * (cfg.l1_weight * l1 + cfg.l2_weight * l2 + cfg.l3_weight * l3)
                + cfg.load_weight * load.queued_tokens + cfg.running_weight * load.running)
        if best is None or cost < best[0]:
            best = (cost, worker, pages, l1, l2, l3)
    return best[1], Overlap(best[2], {"L1": best[3], "L2": best[4], "L3": best[5]})


def local_prefill(index: PrefixIndex, keys: Sequence[int], prompt_len: int, decode: str, cfg: RouterConfig,
                  geom: KVGeometry, recent_pages: int = 0) -> Overlap | None:
    """Conditional disaggregation: the decode worker's usable cached prefix of the prompt when it holds
    some of it and lacks at most ``cfg.local_prefill_tokens`` tokens (it then prefills the rest itself),
    else None (hand it off: a prompt new to it goes to a prefill worker however short). Only pages it
    holds itself count as held (L1/L2, or ``recent_pages``: a prompt just routed to it), and its usable
    prefix ends at a window of sliding pages it holds itself: what only the shared L3 has would be read in
    on the decode worker's side, if at all (an engine looks in L3 for a prompt's pages only past
    ``prefetch_min_tokens`` beyond its own), so it counts as work there."""
    limit, ps = cfg.local_prefill_tokens, geom.page_size
    if limit <= 0 or prompt_len - len(keys) * ps > limit:
        return None
    ov = index.own_overlap(keys, decode, geom.window_pages)
    if recent_pages > ov.pages:
        ov = Overlap(recent_pages, {"L1": recent_pages, "L2": 0, "L3": 0})
    return ov if ov.pages and prompt_len - ov.pages * ps <= limit else None


def pick_decode(loads: Mapping[str, WorkerLoad]) -> str:
    """The decode worker with the most free pages per running request (of equals, the first in ``loads``:
    ``max`` keeps the first of its maxima)."""
    if not loads:
        raise NoWorkerError("no decode worker is available")
    return max(loads, key=lambda w: loads[w].free_pages / (1 + loads[w].running))
