"""What must hold after a soak or a fault: every worker's invariants, every pool free once the cache is
flushed, and per-process memory that did not grow past a bound."""
from __future__ import annotations

import time

import httpx
import ray


def worker_handles(handles: dict) -> dict:
    return handles["workers"]


def process_info(handles: dict) -> dict[str, dict]:
    ws = worker_handles(handles)
    return dict(zip(ws, ray.get([w.process_info.remote() for w in ws.values()], timeout=60)))


def check_integrity(handles: dict) -> None:
    ws = worker_handles(handles)
    ray.get([w.check_integrity.remote() for w in ws.values()], timeout=120)


def flush(url: str, timeout: float = 120.0) -> None:
    """POST /flush_cache until every worker is idle enough to flush (409 means one still runs)."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.post(f"{url}/flush_cache", timeout=60)
        if r.status_code == 200:
            return
        assert r.status_code == 409, r.text
        if time.monotonic() > deadline:
            raise AssertionError(f"flush_cache kept answering 409 for {timeout:.0f}s")
        time.sleep(0.2)


def pools_after_flush(handles: dict) -> dict[str, dict]:
    """Each worker's pool use after a flush; ``assert_all_free`` checks it."""
    ws = worker_handles(handles)
    stats = ray.get([w.stats.remote() for w in ws.values()], timeout=60)
    out = {}
    for wid, st in zip(ws, stats):
        used = {f"L1.{c}": st["pool"][c]["used"] for c in st["pool"]}
        usage = st.get("cache", {}).get("usage", {})
        used.update({f"L1.tree.{c}": n for c, n in usage.get("L1", {}).items()})
        used.update({f"L2.{c}": n for c, n in usage.get("L2", {}).items()})
        used["running"], used["waiting"] = st["running"], st["waiting"]
        out[wid] = used
    return out


def assert_all_free(handles: dict, url: str) -> dict[str, dict]:
    """Flush, then every pool of every worker must be entirely free (DESIGN: no leak). L2 frees its
    pages when the background copies that pinned them finish, so give those a moment."""
    deadline = time.monotonic() + 60
    while True:
        flush(url)
        used = pools_after_flush(handles)
        if all(v == 0 for w in used.values() for v in w.values()):
            return used
        if time.monotonic() > deadline:
            raise AssertionError(f"pages still in use after flush_cache: {used}")
        time.sleep(0.5)


def rss_growth(before: dict[str, dict], after: dict[str, dict]) -> dict[str, int]:
    """Anonymous-RSS growth per worker between two ``process_info`` snapshots of the same processes
    (a worker that restarted in between is a new process: not comparable, left out)."""
    return {w: after[w]["rss_anon_bytes"] - before[w]["rss_anon_bytes"] for w in before
            if w in after and after[w]["pid"] == before[w]["pid"]}
