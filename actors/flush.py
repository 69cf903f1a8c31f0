"""``POST /flush_cache`` over a cluster: every worker flushes, or none does.

Workers flush one by one on their own engine threads, so "all or nothing" takes two phases:

1. **hold**: every worker is asked to hold admissions if it is idle (nothing running, waiting or leased
   for a transfer). One that is busy (or unreachable) answers why; then every hold is released and
   nothing was flushed (409, naming the busy workers).
2. **flush**: held workers cannot become busy, so each flushes its L1, L2 and the L3 marks of its tree,
   and reports the flush to the router (which forgets that worker's pages and every L3 page) before it
   answers. The L3 store is shared: the last worker clears it once the others' flushes have landed
   their pending L3 writes (storage/l3: a file directory is the cluster's own and is emptied; Mooncake
   loses only this model's ``strata/<model_id>/`` keys, never another tenant's). Then the holds are
   released.

The answer says what was flushed per worker and tier, and what the L3 clear removed. A hold lapses by
itself after ``hold_s`` seconds, so a flush whose caller dies never wedges the cluster.
"""
from __future__ import annotations

import asyncio
from typing import Protocol


class Workers(Protocol):
    async def hold(self, handle, seconds: float) -> str | None: ...
    async def release(self, handle) -> None: ...
    async def flush_one(self, handle, l3: bool) -> dict: ...


def _err(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[-1][:200]


async def flush_cluster(ops: Workers, workers: dict, settings=None, hold_s: float = 60.0) -> dict:
    """Flush ``workers`` (name -> handle) all or none; the /flush_cache answer (``flushed`` True or False)."""
    if not workers:
        return {"flushed": False, "reason": "no worker to flush", "workers": {}}
    names = list(workers)
    holds = await asyncio.gather(*(ops.hold(workers[n], hold_s) for n in names), return_exceptions=True)
    busy = {n: (_err(h) if isinstance(h, BaseException) else h) for n, h in zip(names, holds) if h is not None}
    try:
        if busy:
            return {"flushed": False, "reason": "busy: nothing was flushed (retry when idle)", "busy": busy,
                    "workers": {}}
        # The L3 clear last, by one worker, after the others' flushes waited for their L3 writes.
        first, rest = names[-1], names[:-1]
        out = dict(zip(rest, await asyncio.gather(*(ops.flush_one(workers[n], False) for n in rest),
                                                   return_exceptions=True)))
        out[first] = (await asyncio.gather(ops.flush_one(workers[first], True), return_exceptions=True))[0]
        per = {n: ({"flushed": False, "reason": _err(r)} if isinstance(r, BaseException) else r) for n, r in out.items()}
        ok = all(r.get("flushed") for r in per.values())
        store = per[first].pop("L3_store", None)
        error = per[first].pop("L3_store_error", None)
        for r in per.values():
            r.pop("L3_store", None)
        l3cfg = settings.engine.hicache.l3 if settings is not None and settings.engine.hicache is not None else None
        answer = {"flushed": ok and error is None, "workers": per,
                  "L3_store": None if l3cfg is None else {"backend": l3cfg.backend, "scope": l3cfg.flush_scope(),
                                                          "objects_removed": store, "error": error},
                  "router": {"confirmed": all(r.get("router_confirmed", False) for r in per.values())}}
        if not answer["flushed"]:
            answer["reason"] = error or "a worker failed to flush: see workers"
        return answer
    finally:
        await asyncio.gather(*(ops.release(workers[n]) for n in names), return_exceptions=True)
