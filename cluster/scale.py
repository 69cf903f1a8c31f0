"""Scale a running cluster's workers while it serves: ``strata scale --prefill N --decode M``.

Out: new workers (the next free ids of the role) are created with a running worker's settings (engine,
L3 connection, transfer), placed by the cluster's placement policy, and start taking traffic once they
have reported to the router; ingress replicas find them by name.

In: the workers with the highest ids of the role are *drained*: the router sends them nothing new,
their running and queued requests finish and their leases end, their pending write-through copies reach
L2/L3 (so their cache outlives them: other workers hit it in L3), and only then are they removed from
the router and stopped. No request fails because of it.
"""
from __future__ import annotations

import re
import time
from typing import NamedTuple

import ray

from cluster import workers as wk

_ID = re.compile(r"^(prefill|decode|colocated)-(\d+)$")


class ScaleResult(NamedTuple):
    added: list[str]
    removed: list[str]
    seconds: float


def plan(current: list[str], role: str, target: int) -> tuple[list[str], list[str]]:
    """(ids to add, ids to drain) so that ``role`` has ``target`` workers: new ids fill the lowest free
    indices, the highest indices go first."""
    if not isinstance(target, int) or target < 0:
        raise ValueError(f"--{role} must be an int >= 0, got {target!r}")
    have = sorted((int(m.group(2)) for w in current if (m := _ID.match(w)) and m.group(1) == role))
    if target >= len(have):
        free = [i for i in range(target + len(have)) if i not in have][:target - len(have)]
        return [f"{role}-{i}" for i in free], []
    return [], [f"{role}-{i}" for i in have[target:]][::-1]


def scale(cfg, targets: dict[str, int], drain_timeout: float = 120.0, ready_timeout: float = 180.0) -> ScaleResult:
    """Bring each role of ``targets`` ({"prefill": n, ...}) to its count on the connected cluster."""
    t0 = time.monotonic()
    ns = cfg.ray.namespace
    router = ray.get_actor("strata-router", namespace=ns)
    st = ray.get(router.status.remote(), timeout=30)
    known = {w for w in st["workers"] if w not in st["removed"]}
    by_role = {w: s["role"] for w, s in st["workers"].items()}
    for role, n in targets.items():
        if role not in wk.ROLES:
            raise ValueError(f"unknown role {role!r}")
        have = [w for w in known if by_role.get(w) == role]
        if n == 0 and role in ("prefill", "decode") and have:
            raise ValueError(f"--{role} 0 would leave nothing to serve {role}; keep at least 1")
    handles = {w: ray.get_actor(wk.actor_name(w), namespace=ns) for w in known}
    if not handles:
        raise ValueError("no worker is running: start the cluster first (strata serve / ray job submit)")
    engine_cfg, tcfg = ray.get(next(iter(handles.values())).settings.remote(), timeout=30)
    storage = _maybe_actor("strata-storage", ns)
    on = wk.counts(wk.placed_on(handles))
    added, removed = [], []
    for role, n in targets.items():
        add, drain = plan([w for w in known if by_role.get(w) == role], role, n)
        for wid in add:
            handles[wid] = wk.spawn(cfg, wid, role, engine_cfg, router, storage, on, {"lifetime": "detached"})
            added.append(wid)
        removed += drain
    if added:
        ray.get([handles[w].start.remote() for w in added], timeout=ready_timeout)
        wk.wait_reported(router, added, ready_timeout)
    for wid in removed:
        ray.get(router.drain.remote(wid), timeout=30)
    _wait_drained({w: handles[w] for w in removed}, drain_timeout)
    for wid in removed:
        ray.get(router.remove_worker.remote(wid), timeout=30)
        ray.kill(handles.pop(wid), no_restart=True)
    if storage is not None and (added or removed):
        storage.attach.remote(handles)
    return ScaleResult(added, removed, time.monotonic() - t0)


def _wait_drained(workers: dict, timeout: float) -> None:
    # A request routed just before the drain may reach its worker a moment later: two quiet checks
    # a report interval apart, not one.
    deadline = time.monotonic() + timeout
    quiet: dict[str, int] = {w: 0 for w in workers}
    while quiet and any(v < 2 for v in quiet.values()):
        if time.monotonic() > deadline:
            busy = [w for w, v in quiet.items() if v < 2]
            raise TimeoutError(f"workers {busy} still busy after {timeout:.0f}s of draining")
        for w, h in workers.items():
            if quiet[w] < 2:
                quiet[w] = quiet[w] + 1 if ray.get(h.drained.remote(), timeout=60)["busy"] == 0 else 0
        time.sleep(0.2)


def _maybe_actor(name: str, ns: str):
    try:
        return ray.get_actor(name, namespace=ns)
    except ValueError:
        return None
