"""The decode side of prefill/decode disaggregation: the one owner of a transferred request's pages from
the moment they are leased until they are a running request's (or free again).

    reserve  -> (the prefill side sends into the leased pages) ->  admit     ... cancel / expiry on failure

``reserve`` takes the pages a prompt's KV will occupy (full: every page; SWA: the last window,
``KVGeometry.plan_pages``) under a lease (storage/transfer/base.py ``LeaseTable``); ``admit`` commits the
lease, has the transfer backend fill the pages (``TransferBackend.fill``) and makes them the request's
page table (``KVManager.import_leased``). On any failure the pages go back, never stranded. A lease of a
one-sided send that ends before the send did is quarantined until ``send_ended`` or ``release`` (the
sender is dead or says nothing can write any more); ``tick`` expires leases and names the quarantined ones
whose sender should be asked now. Plain (no Ray, time passed in): the worker shell does the asking.

The lease id is the caller's (the ingress names it before any page is leased, and the prefill worker
reserves while it computes), so a cancel can overtake its own reserve: a cancel of an id not held yet
refuses that id's reserve until the lease's time would have run out (``cancel`` with ``now``), rather
than letting it lease pages nobody will send to or commit.

This object knows leases and pages; the Request itself (prompt checks, sampling params) is the Engine's,
which keeps the thin verbs (``reserve_kv``, ``add_leased``) and puts the admitted request in its batch.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from engine.disagg import admit_leased
from engine.kv_manager import KVManager
from engine.request import Request
from engine.stopping import catch_up_first_token
from storage.pools import FULL, SWA
from storage.transfer.base import LeasedPages, LeaseInfo, LeaseStats, LeaseTable, Receipt, TransferBackend, TransferError

PROBE_EVERY_S = 1.0      # a quarantined lease's sender is asked at most this often
MAX_REFUSED = 4096       # at most so many ids cancelled before their reserve are kept (the oldest go first)


class LeaseSweep(NamedTuple):
    """What one ``tick`` did and what it asks of the shell."""
    expired: list[str]                  # leases that ended by their deadline now
    quarantined: list[str]              # those of them whose pages wait for their send to end
    probe: list[tuple[str, str]]        # (lease id, sender id): ask the sender whether it may still write


class KVReceiver:
    def __init__(self, kv: KVManager, vocab_size: int) -> None:
        self.kv = kv
        self.vocab_size = vocab_size
        # Pages reserved for KV transfers still in flight, taken from the same allocators as requests'.
        self.leases = LeaseTable({FULL: kv.pools.full.allocator, SWA: kv.pools.swa.allocator}, "kv leases")
        self._probed: dict[str, float] = {}     # quarantined lease -> when its sender was last asked
        # Ids cancelled before their reserve came -> until when a reserve of them is refused (in that order:
        # every id gets the same ttl but for a run-time change of it, so the oldest expire first).
        self._refused: OrderedDict[str, float] = OrderedDict()

    @property
    def live(self) -> int:
        """Leases between reserve and admit (each the start of a request)."""
        return len(self.leases.leases)

    def reserve(self, lease_id: str, prompt_len: int, now: float, ttl: float, one_sided: bool = False,
                sender: str = "") -> LeasedPages:
        """Lease the pages a transferred prompt of ``prompt_len`` tokens will occupy until ``now + ttl``.
        MemoryError when they cannot be had even after evicting cached pages (nothing is held then);
        ValueError on a reused id or a bad ttl; TransferError when the id was cancelled before (its
        requester gave up). ``sender``: the prefill worker's id ("" unknown)."""
        if not isinstance(prompt_len, int) or prompt_len < 1:
            raise ValueError(f"prompt_len: must be a positive int, got {prompt_len!r}")
        self._forget_refused(now)
        if lease_id in self._refused:
            raise TransferError(f"lease {lease_id!r}: cancelled before it was reserved (its request is over)")
        n_full, first, n_swa = self.kv.geom.plan_pages(prompt_len)
        need = {FULL: n_full, SWA: n_swa}
        for comp, n in need.items():
            if n:
                self.kv.ensure(comp, n)   # evicts cached pages if need be; the lease table allocates
        lease = self.leases.reserve(lease_id, need, now, ttl, LeaseInfo(prompt_len, first, one_sided, sender))
        return lease.leased_pages()

    def admit(self, req: Request, lease_id: str, rec: Receipt | None, now: float, backend: TransferBackend) -> None:
        """Make ``req`` (new, its prompt checked by the Engine) a decoding request over the pages of
        ``lease_id``: commit the lease, have ``backend`` fill them with the KV ``rec`` stands for, import
        them as its page table and take its first token. Raises TransferError when the lease is gone or
        nothing was sent, ValueError on a receipt that does not fit the request or the lease; on any
        error every page of the lease is free again (or quarantined, for a live one-sided send)."""
        try:
            lease = self.leases.get(lease_id, now)
            if rec is None:
                raise TransferError(f"lease {lease_id}: nothing was sent")
            n = len(req.prompt_ids)
            if rec.prompt_len != n or lease.info.prompt_len != n:
                raise ValueError(f"kv transfer: covers {rec.prompt_len} tokens (lease {lease.info.prompt_len}), "
                                 f"prompt has {n}")
            if not 0 <= rec.first_token < self.vocab_size:
                raise ValueError(f"kv transfer: first token {rec.first_token} outside the vocabulary")
        except BaseException:
            self.leases.cancel(lease_id)
            raise
        pages = self.leases.commit(lease_id, now).leased_pages()
        try:
            backend.fill(self.kv.pools, pages, rec)
            admit_leased(req, pages, rec, self.kv)
            catch_up_first_token(req, self.vocab_size)
        except BaseException:
            if self.kv.holds(req):
                self.kv.release(req)
            else:
                self.kv.give_back(pages.as_dict())
            raise

    def cancel(self, lease_id: str, now: float | None = None, ttl: float = 0.0) -> bool:
        """Free a lease's pages now (quarantined instead while a one-sided send may still write); False
        when there is no such live lease. With ``now``: an id not held (its reserve may still be on the
        way) is refused by ``reserve`` until ``now + ttl``."""
        if self.leases.cancel(lease_id):
            return True
        if now is not None and lease_id not in self.leases.quarantine:
            self._forget_refused(now)
            self._refused[lease_id] = now + ttl
            self._refused.move_to_end(lease_id)
            while len(self._refused) > MAX_REFUSED:
                self._refused.popitem(last=False)
        return False

    def _forget_refused(self, now: float) -> None:
        while self._refused:
            lease_id, until = next(iter(self._refused.items()))
            if now < until:
                return
            del self._refused[lease_id]

    def send_ended(self, lease_id: str) -> bool:
        """The sender's send into ``lease_id`` is over: a quarantined lease is freed now (True), a live one
        will be freed at once when it ends."""
        self._probed.pop(lease_id, None)
        return self.leases.send_ended(lease_id)

    def release(self, lease_id: str) -> bool:
        """Free a quarantined lease whose sender is dead or says nothing can write any more."""
        self._probed.pop(lease_id, None)
        return self.leases.release(lease_id)

    def tick(self, now: float) -> LeaseSweep:
        """Expire the leases whose deadline passed, and name each quarantined lease whose sender has not
        been asked for ``PROBE_EVERY_S`` (asked now: the caller does, then ``release``s on a no)."""
        expired = [lease.lease_id for lease in self.leases.expire(now)]
        self._forget_refused(now)
        quarantine = self.leases.quarantine
        for lease_id in [k for k in self._probed if k not in quarantine]:
            del self._probed[lease_id]
        probe = []
        for lease_id, lease in quarantine.items():
            if now - self._probed.get(lease_id, -PROBE_EVERY_S) < PROBE_EVERY_S:
                continue
            self._probed[lease_id] = now
            if lease.info.sender:     # nobody to ask otherwise: only the sender's own end notice frees it
                probe.append((lease_id, lease.info.sender))
        return LeaseSweep(expired, [k for k in expired if k in quarantine], probe)

    # ---- introspection -----------------------------------------------------------------------------
    def owners(self) -> dict[str, dict[str, list[int]]]:
        """component -> {"lease <id>": pages} of every page a lease holds (live or quarantined)."""
        return self.leases.owners()

    def stats(self) -> LeaseStats:
        return self.leases.stats()

    def check_integrity(self) -> None:
        """No page in two leases or free (the allocators' whole check is the Engine's, with every owner)."""
        self.leases.check_integrity(full_check=False)
        for lease_id in self._probed:
            if lease_id not in self.leases.quarantine:
                raise AssertionError(f"kv leases: probe time kept for {lease_id}, which is not quarantined")
        if len(self._refused) > MAX_REFUSED:
            raise AssertionError(f"kv leases: {len(self._refused)} refused ids kept, more than {MAX_REFUSED}")
        for lease_id in self._refused:
            if lease_id in self.leases.leases:
                raise AssertionError(f"kv leases: {lease_id} is refused and leased at once")
