r"""The prefill -> decode handoff of one request, as one typed protocol (plain: no Ray).

    handoff (to the prefill worker) --> first token    the prefill worker, then:  leased (to decode)
      |- reserve (decode)  \  at once, then the send into          ... cancel (decode) on any failure
      |- prefill (its own) /  the leased pages                         before the decode commits

The ingress names the lease (``Reservation``: the decode worker, an id it makes up, the prompt's
length) and asks the prefill worker alone: that worker has the decode worker lease the pages the
prompt's KV will occupy while it computes the prompt itself (``prefill_reserving``), so the reserve's
round trip is off the first token's path; then it sends the KV straight into them (storage/transfer),
answers the first token, and hands the decode half (the ``Receipt``) to the decode worker itself, which
commits the lease and streams the rest to the ingress. Until the commit, any failure or a client that
leaves cancels the lease by its id (a cancel that overtakes its reserve refuses it, engine/pd.py; an
unanswered lease also expires on its own; a one-sided one is quarantined until its send is over), so no
page is stranded.

``KVHandoff`` drives this over a ``Workers`` protocol; the Ray shell (actors/ingress.RayBackend)
implements it over the workers' token channels (actors/token_channel.py: HANDOFF), with their timeouts
and their error mapping; the prefill worker reserves the lease (RESERVE) and hands the decode half on
(LEASED) over the decode worker's channel too: no Ray call on a request's way.
"""
from __future__ import annotations

import asyncio
import uuid
from typing import AsyncIterator, Awaitable, NamedTuple, Protocol

from engine.stream import PrefillResult, StreamItem
from engine.sampling import SamplingParams
from storage.transfer import Destination, TransferError


class Reservation(NamedTuple):
    """The pages one prompt is to lease on a decode worker, named before they are: the prefill worker
    reserves them under ``lease_id``, and the ingress commits or cancels them by it."""
    decode: str
    lease_id: str
    prompt_len: int

    @classmethod
    def new(cls, decode: str, prompt_len: int) -> "Reservation":
        # the shape the decode worker gives the ids it makes itself: whose lease it is shows in any log
        return cls(decode, f"{decode}/{uuid.uuid4().hex[:12]}", prompt_len)


class PeerFailed(RuntimeError):
    """A worker could not reach the peer it hands a request to (``worker``: dead, restarting, gone):
    the ingress answers it as that worker's failure, so a retry avoids it."""

    def __init__(self, msg: str, worker: str) -> None:
        super().__init__(msg)
        self.worker = worker

    def __reduce__(self):   # keep ``worker`` across processes
        return (PeerFailed, (str(self), self.worker))


class Workers(Protocol):
    def handoff(self, prefill: str, ids: list[int], params: SamplingParams, res: Reservation,
                whole: bool = False) -> AsyncIterator[StreamItem]:
        """The prefill worker's first token's item (finish_reason "prefill" when the request goes on),
        then the decode worker's items. The prefill worker reserves ``res`` itself, and hands the decode
        half to ``res.decode``; a decode worker it cannot reach is a ``PeerFailed`` naming it."""

    def cancel(self, decode: str, lease_id: str) -> None:
        """Fire and forget: a no-op once committed; a dead worker holds no leases; ahead of its reserve,
        the lease is refused when that comes."""

    def generate(self, worker: str, ids: list[int], params: SamplingParams,
                 whole: bool = False) -> AsyncIterator[StreamItem]:
        """``whole`` (here and in decode_leased): the reader wants only the whole answer; the worker may send
        many steps' tokens as one item."""


class KVHandoff:
    def __init__(self, workers: Workers) -> None:
        self.workers = workers

    async def run(self, ids: list[int], params: SamplingParams, prefill: str,
                  decode: str | None, whole: bool = False) -> AsyncIterator[StreamItem]:
        """Stream one request's items: through ``prefill`` alone (colocated) or handed off to ``decode``.
        The last carries the prefill side's cached-token counts. (Which workers served it is the caller's
        choice, known before: it travels beside the items, actors/served.py.) ``whole``: a non-streamed
        request (Workers.generate). A request that ends at its first token (max_new_tokens <= 1: a score,
        a loglikelihood) has no decode phase: the prefill worker serves it alone, with no lease and no
        transfer."""
        if decode is None or params.max_new_tokens <= 1:
            async for item in self.workers.generate(prefill, ids, params, whole):
                yield item
            return
        res = Reservation.new(decode, len(ids))
        committed = False
        items = self.workers.handoff(prefill, ids, params, res, whole)
        try:
            first = await anext(items)
            if first.finished and first.finish_reason != "prefill":   # done at its first token
                yield first
                return
            cached, by_tier = first.cached_tokens, first.cached_tokens_by_tier
            first.finished, first.finish_reason = False, None
            yield first
            async for item in items:
                committed = True
                if item.finished:
                    item.cached_tokens, item.cached_tokens_by_tier = cached, by_tier
                yield item
        finally:
            await items.aclose()   # a client that left: the prefill worker's part stops too
            if not committed:   # the lease may not exist yet (or ever): the decode side copes
                self.workers.cancel(decode, res.lease_id)


async def prefill_reserving(prefill: Awaitable[PrefillResult], reserve: "asyncio.Future[Destination]",
                            wait: float, decode: str = "the decode worker") -> tuple[PrefillResult, Destination | None]:
    """The prefill worker's half of a handoff: compute the prompt (``prefill``) while the decode worker
    leases its pages (``reserve``, under way already). A reserve that fails first stops the prefill (its
    KV would go nowhere) and raises the reserve's error. A prompt whose first token ended the request
    needs no pages: (result, None) at once, the reserve left to land or not (its lease is the ingress's
    to cancel). Else the Destination, waited for until ``wait`` seconds have passed since the call
    (TransferError past that: no time would be left to send). ``reserve`` is never cancelled here: it is
    a call to another process, whose outcome (a lease, or none) the caller may still need to know."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    task = asyncio.ensure_future(prefill)
    try:
        await asyncio.wait((task, reserve), return_when=asyncio.FIRST_COMPLETED)
        if not task.done():             # the reserve answered first: its error stops the prefill (below)
            reserve.result()
        res = await task                    # the prefill's error, if it failed
        if res.payload is None or res.first.finish_reason != "prefill":
            return res, None
        if not reserve.done():
            await asyncio.wait((reserve,), timeout=max(deadline - loop.time(), 0.0))
        if not reserve.done():
            raise TransferError(f"{decode} did not lease the pages within {wait:.1f} s")
        return res, reserve.result()
    finally:
        if not task.done():
            task.cancel()       # aborts the engine's request: nothing is computed or exported for nobody
        if not reserve.done():
            reserve.add_done_callback(_retrieved)
        elif not reserve.cancelled():
            reserve.exception()   # an error nobody raised is not an "exception never retrieved"


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
