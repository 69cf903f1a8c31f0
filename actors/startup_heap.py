"""A long-lived actor's startup heap, frozen out of Python's cyclic GC once the actor is built.

What a worker, the router or the storage actor allocates while it starts (torch, Ray, the model, the
engine's tables: 210,000-240,000 tracked objects in a worker, the router or the storage actor) lives as
long as the process. Python's full collection walks all of it: 104-153 ms in each of those processes of a
1P+1D server on the 2-core machines (``python -m bench.overhead --gc``), 350-480 ms in a slower minute
(session 37). A full collection comes by itself as requests leave long-lived objects behind (or when Ray's
global GC asks), and it holds the GIL throughout: every stream of that worker stops meanwhile, or every
route of the cluster in the router. Frozen (``gc.freeze``, after one last collection, so no garbage is
frozen with it), the startup heap is never walked again: the same collection then takes 2-3.5 ms, as in
the ingress replica, which Ray Serve freezes so itself (``RAY_SERVE_FREEZE_GC_ON_STARTUP``). Objects
made later (the radix tree's nodes, requests) are collected as before.
"""
from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect, then move every object tracked now to the permanent generation (the caller's startup is
    over; a restarted actor freezes its own new heap again)."""
    gc.collect()
    gc.freeze()


__all__ = ["freeze_startup_heap"]
