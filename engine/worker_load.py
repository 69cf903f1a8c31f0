"""A worker's load as its reports carry it to the router (every 50 ms, over the route channel or Ray).

The router routes by it (``queued_tokens``, ``running``: the prefill worker's cost; ``free_pages`` per
``running``: the decode worker) and counts each request it routes into it until the next report, so a
burst spreads out; ``/metrics`` shows it per worker. Torch-free: the router and the ingress read it."""
from __future__ import annotations

from typing import NamedTuple, Optional


class WorkerLoad(NamedTuple):
    """One snapshot of a worker's engine (read racily from outside its thread: ints, cheap).

    queued_tokens: prompt tokens not yet prefilled (waiting requests, and running ones not decoding yet).
    running, waiting: requests in the batch and queued for it.
    free_pages, total_pages: the L1 full-attention pool.
    With an L2 (host) tier only, for ``/metrics``: ``host_kv_bytes`` held there, ``kv_moved_bytes`` per
    direction ("L1->L2", ...), ``kv_loadback_pages`` per kind (loaded, used, wasted, deferred)."""
    queued_tokens: int = 0
    running: int = 0
    waiting: int = 0
    free_pages: int = 0
    total_pages: int = 0
    host_kv_bytes: Optional[int] = None
    kv_moved_bytes: Optional[dict[str, int]] = None
    kv_loadback_pages: Optional[dict[str, int]] = None

    def routed(self, prompt_len: int = 0, running: int = 0) -> WorkerLoad:
        """This load with a request just routed here counted in (until the worker's next report)."""
        return self._replace(queued_tokens=self.queued_tokens + prompt_len, running=self.running + running)

    def as_document(self) -> dict:
        """For status and ``/metrics`` (JSON): the fields, without the tiers' when there is no L2."""
        d = self._asdict()
        return d if self.host_kv_bytes is not None else {k: v for k, v in d.items() if v is not None}


__all__ = ["WorkerLoad"]
