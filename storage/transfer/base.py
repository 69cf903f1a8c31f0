"""Prefill->decode KV transfer: the one interface every backend implements, and the lease table.

The flow of one request (the actor shells drive it; nothing here imports ray):

1. decode side ``reserve`` (engine/pd.py): the engine allocates the pages the prompt's KV will occupy --
   full pages for the whole prompt, SWA pages for the last window only (``KVGeometry.plan_pages``,
   storage/geometry.py) -- and puts them under a **lease** (its ``LeaseInfo``) that expires
   ``lease_seconds`` later. The ``Destination`` made of them names those pages and, for one-sided
   backends, how to reach them (``PeerInfo``: agent metadata, registered pools).
2. prefill side ``send``: computes the prompt, then moves its KV into exactly those pages (one-sided) or
   packs it into the ``Receipt`` (ray_object). The prefill side holds its own (staging) pages until the
   send completes, fails or times out, then frees them.
3. decode side ``commit``: the lease ends, the backend's ``fill`` makes its pages hold the KV, and they
   become the request's; decode starts.

A lease that expires, a cancel (the prefill worker failed, the client left) or a dead peer frees the
pages at once; a commit after that is a clean ``TransferError``, never stale tokens. Time is passed in
(``now``), so tests control it.

One-sided backends (NIXL, Mooncake) write into the pages without the decode side taking part, so a
lease that ends while its sender may still write does not free its pages: they are **quarantined**
until the sender says its send is over (done, failed or aborted: ``send_ended``) or is known dead
(``release``). A late write then lands in pages nobody reads, never in another request's KV.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, NamedTuple

from storage.allocator import PageAllocator

if TYPE_CHECKING:   # the payload holds tensors; the ingress imports these types without torch
    from storage.transfer.payload import KVPayload


class TransferError(RuntimeError):
    """A transfer that failed, timed out or whose lease is gone: the request fails cleanly.
    ``in_flight``: the send could not be aborted and may still write (its end is reported later,
    through the backend's ``on_send_ended``)."""

    def __init__(self, msg: str, in_flight: bool = False) -> None:
        super().__init__(msg)
        self.in_flight = in_flight

    def __reduce__(self):   # keep in_flight across processes
        return (TransferError, (str(self), self.in_flight))


class PoolRegion(NamedTuple):
    """One L1 pool as a decode worker registered it: layout [layers, num_pages, page_bytes] at ``base``."""
    base: int
    num_pages: int
    layers: int
    page_bytes: int
    nbytes: int


@dataclass(frozen=True)
class PeerInfo:
    """How a prefill side reaches a decode worker's pages (one-sided backends; empty for ray_object)."""
    agent: str = ""                 # NIXL: the agent's name (a restarted worker has a new one)
    agent_meta: bytes = b""         # NIXL: the agent's metadata, loaded by the prefill side once per name
    session: str = ""               # Mooncake: the TransferEngine's "host:rpc_port"
    regions: Mapping[str, PoolRegion] = field(default_factory=dict)   # component -> its registered pool


class LeaseInfo(NamedTuple):
    """What a decode-side lease is for. ``one_sided``: its sender writes without the decode side taking
    part (the pages are quarantined when the lease ends before the send did); ``sender``: the prefill
    worker's id, asked before quarantined pages are freed ("" nobody to ask)."""
    prompt_len: int
    swa_first_page: int = 0
    one_sided: bool = False
    sender: str = ""


class LeasedPages(NamedTuple):
    """The decode-side pages one lease holds for a transferred prompt of ``prompt_len`` tokens.

    full: [n_full] page indices for logical pages [0, n_full)
    swa:  [n_swa] page indices for logical pages [swa_first_page, n_full) (the last window only)
    """
    lease_id: str
    prompt_len: int
    full: list[int]
    swa: list[int]
    swa_first_page: int

    def as_dict(self) -> dict[str, list[int]]:
        """component -> pages (for the allocators)."""
        return {"full": self.full, "swa": self.swa}


@dataclass
class Destination:
    """Where one request's KV goes: the decode worker's leased pages (picklable, sent to the prefill side).

    full_pages: [n_full] decode-side page indices for logical pages [0, n_full)
    swa_pages:  [n_swa] decode-side page indices for logical pages [swa_first_page, n_full)
    peer: how to reach them (one-sided backends: NIXL agent, Mooncake session, registered pools).
    """

    lease_id: str
    backend: str
    prompt_len: int
    page_size: int
    full_pages: list[int]
    swa_pages: list[int]
    swa_first_page: int
    ttl: float                      # seconds the lease had left when it was handed out
    worker_id: str = ""
    peer: PeerInfo = field(default_factory=PeerInfo)

    @classmethod
    def of(cls, pages: LeasedPages, backend: "TransferBackend", page_size: int, ttl: float,
           worker_id: str = "") -> "Destination":
        return cls(pages.lease_id, backend.name, pages.prompt_len, page_size, pages.full, pages.swa,
                   pages.swa_first_page, ttl, worker_id, backend.peer_info())


@dataclass
class Lease:
    lease_id: str
    pages: dict[str, list[int]]     # component -> page indices held
    expires_at: float
    info: LeaseInfo | None = None   # None: a lease with no transfer behind it (the staging buffer's)
    send_ended: bool = False        # the sender said its send is over: nothing can write any more

    def leased_pages(self) -> LeasedPages:
        return LeasedPages(self.lease_id, self.info.prompt_len, list(self.pages.get("full", [])),
                           list(self.pages.get("swa", [])), self.info.swa_first_page)


@dataclass(frozen=True)
class LeaseStats:
    """A lease table's counters (each lease's end counted once) and what it holds now: ``live`` leases,
    ``in_quarantine`` ones (ended while a one-sided send may still write), ``pages`` held per component."""
    reserved: int = 0
    committed: int = 0
    cancelled: int = 0
    expired: int = 0
    quarantined: int = 0
    released: int = 0
    live: int = 0
    in_quarantine: int = 0
    pages: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class SendStats:
    """One backend end's counters: sends done, failed, timed out, abandoned to the reaper (a one-sided
    write that could not be aborted), bytes moved; and, for staged backends, staging pages in use / total."""
    sends: int = 0
    failed: int = 0
    timeouts: int = 0
    abandoned: int = 0
    bytes: int = 0
    staging_pages_used: int = 0
    staging_pages: int = 0


@dataclass(frozen=True)
class TransferStats:
    """A worker's end of P/D transfer: its backend, the leases it holds (decode side), its sends."""
    backend: str
    leases: LeaseStats
    sends: SendStats


class LeaseTable:
    """Pages held for transfers in flight, per component allocator, each under a deadline.

    Every page a lease holds was taken from its allocator by ``reserve`` and goes back exactly once: by
    ``cancel``, by ``expire`` once ``now`` passes its deadline, or to the caller by ``commit`` (who owns
    it from then on). Used on the decode side (destination pages) and the prefill side (staging pages).
    """

    def __init__(self, allocators: Mapping[str, PageAllocator], name: str = "leases") -> None:
        self.allocators = dict(allocators)
        self.name = name
        self.leases: dict[str, Lease] = {}
        self.quarantine: dict[str, Lease] = {}    # ended leases whose one-sided send may still write
        self.counts = {"reserved": 0, "committed": 0, "cancelled": 0, "expired": 0, "quarantined": 0,
                       "released": 0}

    def reserve(self, lease_id: str, need: Mapping[str, int], now: float, ttl: float,
                info: LeaseInfo | None = None) -> Lease:
        """Take ``need[c]`` pages of every component, all or nothing. Raises MemoryError when an
        allocator is short (nothing taken), ValueError on a reused id or a bad ttl."""
        if lease_id in self.leases:
            raise ValueError(f"{self.name}: lease {lease_id!r} already exists")
        if not ttl > 0:
            raise ValueError(f"{self.name}: ttl must be > 0, got {ttl!r}")
        unknown = set(need) - set(self.allocators)
        if unknown:
            raise ValueError(f"{self.name}: unknown components {sorted(unknown)}")
        for comp, n in need.items():
            if n < 0:
                raise ValueError(f"{self.name}: cannot reserve {n} {comp} pages")
            if not self.allocators[comp].can_alloc(n):
                raise MemoryError(f"{self.name}: {n} {comp} pages requested, "
                                  f"{self.allocators[comp].num_free} free")
        pages = {comp: self.allocators[comp].alloc(n) if n else [] for comp, n in need.items()}
        lease = Lease(lease_id, pages, now + ttl, info)
        self.leases[lease_id] = lease
        self.counts["reserved"] += 1
        return lease

    def get(self, lease_id: str, now: float) -> Lease:
        """The live lease (expiring it first when its deadline passed); TransferError if gone."""
        lease = self.leases.get(lease_id)
        if lease is not None and now >= lease.expires_at:
            self._free(lease, "expired")
            lease = None
        if lease is None:
            raise TransferError(f"{self.name}: lease {lease_id!r} expired or was cancelled")
        return lease

    def commit(self, lease_id: str, now: float) -> Lease:
        """End the lease and hand its pages to the caller. TransferError when it expired, was cancelled,
        or was committed already (its pages are then free or owned by someone else)."""
        lease = self.get(lease_id, now)
        del self.leases[lease_id]
        self.counts["committed"] += 1
        return lease

    def cancel(self, lease_id: str) -> bool:
        """Free a lease's pages now; False when there is no such live lease."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return False
        self._free(lease, "cancelled")
        return True

    def expire(self, now: float) -> list[Lease]:
        """Free every lease whose deadline has passed; returns them."""
        gone = [l for l in self.leases.values() if now >= l.expires_at]
        for lease in gone:
            self._free(lease, "expired")
        return gone

    def cancel_all(self) -> int:
        n = len(self.leases)
        for lease in list(self.leases.values()):
            self._free(lease, "cancelled")
        return n

    def _free(self, lease: Lease, why: str) -> None:
        del self.leases[lease.lease_id]
        self.counts[why] += 1
        if lease.info is not None and lease.info.one_sided and not lease.send_ended:
            self.quarantine[lease.lease_id] = lease
            self.counts["quarantined"] += 1
            return
        self._give_back(lease)

    def _give_back(self, lease: Lease) -> None:
        for comp, pages in lease.pages.items():
            if pages:
                self.allocators[comp].free(pages)

    def send_ended(self, lease_id: str) -> bool:
        """The sender's send for ``lease_id`` is over (done, failed, aborted, or never to start): a live
        lease may now be freed at once when it ends; a quarantined one is freed now. True if it freed."""
        lease = self.leases.get(lease_id)
        if lease is not None:
            lease.send_ended = True
            return False
        return self.release(lease_id)

    def release(self, lease_id: str) -> bool:
        """Free a quarantined lease's pages (its sender ended the send, or is dead)."""
        lease = self.quarantine.pop(lease_id, None)
        if lease is None:
            return False
        self._give_back(lease)
        self.counts["released"] += 1
        return True

    def _held(self):
        return list(self.leases.values()) + list(self.quarantine.values())

    def num_pages(self, comp: str) -> int:
        return sum(len(l.pages.get(comp, ())) for l in self._held())

    def owners(self) -> dict[str, dict[str, list[int]]]:
        """component -> {"lease <id>": pages}: for the allocators' ownership checks."""
        out: dict[str, dict[str, list[int]]] = {c: {} for c in self.allocators}
        for lease in self._held():
            for comp, pages in lease.pages.items():
                out[comp][f"lease {lease.lease_id}"] = list(pages)
        return out

    def check_integrity(self, full_check: bool = True) -> None:
        """No page in two leases or on a free list; with ``full_check`` the allocators' own checks
        too (only valid when the leases are the allocators' sole owners besides the free list)."""
        for comp, alloc in self.allocators.items():
            seen: set[int] = set()
            for lease in self._held():
                for p in lease.pages.get(comp, ()):
                    if p in seen:
                        raise AssertionError(f"{self.name}: {comp} page {p} held by two leases")
                    if not 0 <= p < alloc.num_pages or alloc._is_free[p]:
                        raise AssertionError(f"{self.name}: {comp} page {p} of lease is free or out of range")
                    seen.add(p)
            if full_check:
                alloc.check_integrity({f"lease {l.lease_id}": l.pages.get(comp, []) for l in self._held()})

    def stats(self) -> LeaseStats:
        return LeaseStats(**self.counts, live=len(self.leases), in_quarantine=len(self.quarantine),
                          pages={c: self.num_pages(c) for c in self.allocators})


def coalesce(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge (src, dst, nbytes) copies that continue each other on both sides: fewer descriptors. The
    copies are independent, so they are sorted by source first (pages recycled through the allocator's
    free list often come back in descending order, contiguous all the same)."""
    out: list[list[int]] = []
    for s, d, n in sorted(spans):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += n
        else:
            out.append([s, d, n])
    return [tuple(x) for x in out]


class TransferBackend(ABC):
    """One worker's end of a backend. The decode side publishes ``peer_info`` (put into each
    Destination) and may wait for arrival; the prefill side ``send``s a staged payload."""

    name = "base"
    one_sided = False               # writes into the decode side's pages without it taking part
    on_send_ended = None            # callable(lease_id): an in-flight send (see TransferError) ended

    def peer_info(self) -> PeerInfo:
        """What a prefill side needs to reach this worker's pages (empty for two-sided backends)."""
        return PeerInfo()

    @abstractmethod
    def send(self, payload: KVPayload, dest: Destination, timeout: float) -> Receipt:
        """Move ``payload`` into ``dest``; raises TransferError on failure or past ``timeout``."""

    def wait_arrival(self, lease_id: str, timeout: float) -> None:
        """Decode side: block until the data of ``lease_id`` is known to have landed (one-sided backends;
        the worker calls it off the engine thread before admitting the request)."""

    def fill(self, pools, pages: LeasedPages, rec: Receipt) -> None:
        """Decode side, on the engine thread at admission: make ``pages`` hold the KV ``rec`` stands for.
        A one-sided backend wrote them in place before ``wait_arrival`` returned: nothing is left to do.
        Raises TransferError when the data cannot be (the pages stay the caller's to free)."""
        if not self.one_sided:
            raise NotImplementedError(f"{self.name}: a two-sided backend must fill the pages itself")

    def forget(self, lease_id: str) -> None:
        """Decode side: drop any arrival record of a lease that ended."""

    def in_flight(self) -> set[str]:
        """Prefill side: leases whose send could not be aborted and may still write."""
        return set()

    def reap(self) -> None:
        """Prefill side: finish off sends that could not be aborted (called periodically)."""

    def _ended(self, lease_id: str) -> None:
        cb = self.on_send_ended
        if cb is not None:
            cb(lease_id)

    def stats(self) -> SendStats:
        return SendStats()

    def close(self) -> None:
        pass


def check_fits(payload: KVPayload, dest: Destination) -> int:
    """Raise TransferError unless ``payload`` fills ``dest``'s pages; returns the offset of
    its first SWA page inside ``dest.swa_pages`` (an export may start its window later than reserved)."""
    n_full = len(dest.full_pages)
    if payload.prompt_len != dest.prompt_len or payload.page_size != dest.page_size:
        raise TransferError(f"kv of {payload.prompt_len} tokens/page {payload.page_size} does not match the "
                            f"destination's {dest.prompt_len}/{dest.page_size}")
    if payload.full.numel() and payload.full.shape[1] != n_full:
        raise TransferError(f"kv has {payload.full.shape[1]} full pages, destination {n_full}")
    off = payload.swa_first_page - dest.swa_first_page
    n_swa = payload.swa.shape[1] if payload.swa.numel() else 0
    if dest.swa_pages or n_swa:
        if off < 0 or off + n_swa != len(dest.swa_pages):
            raise TransferError(f"kv SWA pages [{payload.swa_first_page}, +{n_swa}) do not fit the destination's "
                                f"[{dest.swa_first_page}, +{len(dest.swa_pages)})")
    return max(off, 0)


class Receipt(NamedTuple):
    """What the decode side needs besides the page bytes to admit a transferred request."""
    prompt_len: int
    first_token: int
    swa_first_page: int
    swa_valid_from: int
    bytes: int = 0
    seconds: float = 0.0
    descriptors: int = 0
    packed: KVPayload | None = None   # ray_object: the packed KV itself (it travels through the object store)
    sender: str = ""                # the prefill worker that sent it
    offloaded_pages: int = 0        # KVPayload.offloaded_pages / offloaded_to: the prompt's pages the
    offloaded_to: str = ""          # sender writes through to that L3 store


def receipt(payload: KVPayload, **extra) -> Receipt:
    return Receipt(payload.prompt_len, payload.first_token, payload.swa_first_page, payload.swa_valid_from,
                   **{"bytes": payload.nbytes, "offloaded_pages": payload.offloaded_pages,
                      "offloaded_to": payload.offloaded_to, **extra})
