"""The prefill -> decode handoff of one request, as one typed protocol (plain: no Ray).

    reserve (decode)  ->  prefill_to (prefill)  ->  decode_leased (decode)      ... cancel on any failure

The decode worker leases the pages the prompt's KV will occupy (a ``Reservation``); the prefill worker
computes the prompt and sends its KV straight into them (storage/transfer), answering with the first
token and a ``Receipt``; the decode worker commits the lease and streams the rest. Until the commit, any
failure or a client that leaves cancels the lease (an unanswered one also expires on its own; a
one-sided one is quarantined until its send is over), so no page is stranded.

``KVHandoff`` drives this over a ``Workers`` protocol; the Ray shell (actors/ingress.RayBackend)
implements that protocol with the actors' ``.remote`` calls, their timeouts and their error mapping.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator, NamedTuple, Protocol, TypeAlias

from engine.async_engine import StreamItem
from engine.sampling import SamplingParams
from storage.transfer import Destination
from storage.transfer.base import Receipt

if TYPE_CHECKING:   # only named in a type: the handoff itself runs without Ray
    from ray import ObjectRef

# What the prefill worker's send answered, as the decode worker is handed it: over Ray, the reference to
# the prefill task's second return (``ObjectRef[Receipt | None]``, passed on unread: for ray_object it
# holds the packed KV, which the decode worker reads from the object store itself); in process, the
# ``Receipt`` itself. None (or a reference to None): nothing was sent.
ReceiptRef: TypeAlias = "ObjectRef[Receipt | None] | Receipt | None"


class Reservation(NamedTuple):
    """Leased pages on a decode worker for one prompt, and how the prefill worker reaches them."""
    decode: str
    dest: Destination

    @property
    def lease_id(self) -> str:
        return self.dest.lease_id


class Workers(Protocol):
    async def reserve(self, decode: str, prompt_len: int, prefill: str) -> Destination: ...

    async def prefill_to(self, prefill: str, ids: list[int], params: SamplingParams, res: Reservation
                         ) -> tuple[StreamItem, ReceiptRef]:
        """(first token's StreamItem, the Receipt or a reference to it, passed on as is)."""

    def decode_leased(self, decode: str, ids: list[int], lease_id: str, receipt: ReceiptRef,
                      params: SamplingParams) -> AsyncIterator[StreamItem]: ...

    def cancel(self, decode: str, lease_id: str) -> None:
        """Fire and forget: a no-op once committed; a dead worker holds no leases."""

    def generate(self, worker: str, ids: list[int], params: SamplingParams) -> AsyncIterator[StreamItem]: ...


class KVHandoff:
    def __init__(self, workers: Workers) -> None:
        self.workers = workers

    async def run(self, ids: list[int], params: SamplingParams, prefill: str,
                  decode: str | None) -> AsyncIterator[StreamItem]:
        """Stream one request's items: through ``prefill`` alone (colocated) or handed off to ``decode``.
        The last carries the prefill side's cached-token counts. (Which workers served it is the caller's
        choice, known before: it travels beside the items, actors/served.py.)"""
        if decode is None:
            async for item in self.workers.generate(prefill, ids, params):
                yield item
            return
        res = Reservation(decode, await self.workers.reserve(decode, len(ids), prefill))
        committed = False
        try:
            first, receipt = await self.workers.prefill_to(prefill, ids, params, res)
            if first.finished and first.finish_reason != "prefill":   # done at its first token
                yield first
                return
            cached, by_tier = first.cached_tokens, first.cached_tokens_by_tier
            first.finished, first.finish_reason = False, None
            yield first
            async for item in self.workers.decode_leased(decode, ids, res.lease_id, receipt, params):
                committed = True
                if item.finished:
                    item.cached_tokens, item.cached_tokens_by_tier = cached, by_tier
                yield item
        finally:
            if not committed:
                self.workers.cancel(decode, res.lease_id)
