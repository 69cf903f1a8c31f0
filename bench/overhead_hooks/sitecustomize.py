"""bench/overhead.py --profile only: put on PYTHONPATH of the server it starts, this counts every Ray
actor-method call each Python process makes (``ActorMethod._remote``, by method name) and every
streamed item it receives (``ObjectRefGenerator._next_async``) and writes the
counts to $STRATA_OVERHEAD_CALLS/<pid>.json once a second; with --hops --switch-interval it sets the GIL's
switch interval; with --timeline ($STRATA_OVERHEAD_TIMELINE) it marks the points of a request's way
(timeline_hooks.py). Production code never imports it."""
import os

_DIR = os.environ.get("STRATA_OVERHEAD_CALLS")


def _install() -> None:
    import collections
    import json
    import sys
    import threading
    import time

    counts: collections.Counter = collections.Counter()

    def patch() -> None:
        while "ray.actor" not in sys.modules:
            time.sleep(0.2)
        time.sleep(0.2)   # the module finished importing
        am = sys.modules["ray.actor"].ActorMethod
        orig = am._remote

        def counted(self, *a, **kw):
            counts[getattr(self, "_method_name", "?")] += 1
            return orig(self, *a, **kw)
        am._remote = counted
        # Items a streaming call delivers to this process (one Ray object each), by the caller's side.
        while "ray._private.object_ref_generator" not in sys.modules:
            time.sleep(0.2)
        gen = sys.modules["ray._private.object_ref_generator"].ObjectRefGenerator
        orig_next = gen._next_async

        async def counted_next(self, *a, **kw):
            ref = await orig_next(self, *a, **kw)
            counts["<stream item>"] += 1
            return ref
        gen._next_async = counted_next
        path = os.path.join(_DIR, f"{os.getpid()}.json")
        while True:
            time.sleep(1.0)
            try:
                tmp = path + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(dict(counts), f)
                os.replace(tmp, path)
            except OSError:
                pass

    threading.Thread(target=patch, name="overhead-calls", daemon=True).start()


if _DIR:
    _install()
# An experiment of --hops --switch-interval: the GIL's switch interval of every Python process of the server
# (CPython's default 5 ms; a thread waiting for the GIL asks for it after that long).
if os.environ.get("STRATA_OVERHEAD_SWITCH_INTERVAL"):
    import sys as _sys
    _sys.setswitchinterval(float(os.environ["STRATA_OVERHEAD_SWITCH_INTERVAL"]))
if os.environ.get("STRATA_OVERHEAD_TIMELINE"):
    import timeline_hooks as _timeline
    _timeline.install()
