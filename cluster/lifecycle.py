"""How a launch starts next to, and stops, a strata cluster: signals, the drain, and what to do with a
cluster that is already running in the namespace (``--if-exists adopt|replace|fail``).

Why adopt is the default: re-submitting the same RayJob (KubeRay retries it up to ``backoffLimit``, a user
re-applies it) must not fail because the named detached actors exist, and must not cut the requests a
healthy cluster is serving. Adopt keeps whatever is running and only (re)creates what is missing; it does
not apply a changed YAML to the running actors: that is what ``replace`` is for (and the RayJob manifest
passes it, since re-applying that job is how a changed cluster.yaml is applied)."""
from __future__ import annotations

import signal
import sys
import threading
import time

import ray
from ray import serve

APP_NAME = "strata"                 # the Serve application (route "/") of every launch
PLACEMENT_GROUP = "strata-workers"      # left by deployments from before per-node placement (cluster/placement.py)
STORAGE_ACTOR = "strata-storage"
ROUTER_ACTOR = "strata-router"


class Stopped(KeyboardInterrupt):
    """A signal arrived before the cluster was serving. A KeyboardInterrupt because that is the one
    exception Ray's blocking calls let a signal handler raise (they turn it into a plain
    KeyboardInterrupt; any other one comes out as a SystemError), and no ``except Exception`` on the way
    up swallows it."""


class Signals:
    """SIGINT and SIGTERM, both installed explicitly: a non-interactive shell starts a background job with
    SIGINT ignored (``strata serve &``), and Python keeps an inherited SIG_IGN; ray.init also replaces the
    SIGTERM handler with one that exits on the spot. While starting, a signal raises ``Stopped``; once
    serving, the first one starts the drain and a second one cuts it short. The handler never raises
    after that, so no KeyboardInterrupt can surface half-way through the shutdown."""

    def __init__(self) -> None:
        self.received: list[str] = []
        self.starting = True
        self._event = threading.Event()

    def install(self) -> "Signals":
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self._on_signal)
        return self

    def _on_signal(self, signum, _frame) -> None:
        self.received.append(signal.Signals(signum).name)
        self._event.set()
        if self.starting:
            self.starting = False       # the cleanup that follows runs to its end
            raise Stopped(self.received[-1])
        if len(self.received) == 2:
            print(f"strata: {self.received[-1]} again: stopping now", file=sys.stderr, flush=True)

    def wait(self) -> str:
        """Block until the first signal; returns its name."""
        self.starting = False
        while not self._event.wait(3600):
            pass
        return self.received[0]

    @property
    def hurry(self) -> bool:
        return len(self.received) > 1


def drain(timeout: float, hurry=lambda: False, app: str = APP_NAME) -> tuple[int, float]:
    """Tell the ingress to take no new request and wait, at most ``timeout`` s (less when ``hurry()``
    turns true), until the requests in flight are done. Returns (requests still in flight, seconds).
    Assumes one ingress replica (what launch deploys): a handle call reaches one replica."""
    t0 = time.monotonic()
    try:
        h = serve.get_app_handle(app)
        n = h.drain.remote().result(timeout_s=10)
        while n and not hurry() and time.monotonic() - t0 < timeout:
            time.sleep(0.1)
            n = h.inflight.remote().result(timeout_s=10)
    except Exception as e:  # noqa: BLE001 - no app, a placeholder, a dead replica: nothing to wait for
        print(f"strata: no drain ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})",
              file=sys.stderr, flush=True)
        return 0, time.monotonic() - t0
    if n == 0:
        # The replica counts a stream done when its last chunk is handed to Serve; give the proxy a moment
        # to pass it on before the proxy itself is stopped.
        time.sleep(0.3)
    return n, time.monotonic() - t0


def running_actors(namespace: str) -> list[str]:
    """strata's named actors alive in ``namespace`` (router, workers, storage, EPLB)."""
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == namespace and a["name"].startswith("strata-"))


def app_phase(app: str = APP_NAME, timeout: float = 10.0) -> str | None:
    """"ready", "draining", "starting" (the placeholder), "unhealthy", or None where there is no app."""
    try:
        status = serve.status().applications.get(app)
    except Exception:  # noqa: BLE001 - Serve not started on this cluster
        return None
    if status is None:
        return None
    if str(getattr(status.status, "value", status.status)) != "RUNNING":
        return "unhealthy"
    try:
        return serve.get_app_handle(app).phase.remote().result(timeout_s=timeout)
    except Exception:  # noqa: BLE001 - an older ingress without phase(), or no replica answers
        return "unhealthy"


def tear_down(namespace: str, drain_timeout: float, app: str = APP_NAME, timeout: float = 60.0) -> list[str]:
    """Drain and delete the Serve app, kill strata's named actors in ``namespace`` and remove the named
    placement group; returns the actors it killed. Waits until the names are free, so a deploy can
    create them again right after."""
    if app_phase(app) in ("ready", "draining"):
        left, secs = drain(drain_timeout, app=app)
        print(f"strata: drained the running app in {secs:.1f}s ({left} requests cut)", flush=True)
    try:
        serve.delete(app)
    except Exception:  # noqa: BLE001 - Serve not running there
        pass
    names = running_actors(namespace)
    for name in names:
        try:
            a = ray.get_actor(name, namespace=namespace)
        except ValueError:
            continue
        if name == STORAGE_ACTOR:
            try:
                ray.get(a.shutdown.remote(), timeout=30)    # stops the L3 master it started
            except Exception:  # noqa: BLE001
                pass
        ray.kill(a, no_restart=True)
    try:
        ray.util.remove_placement_group(ray.util.get_placement_group(PLACEMENT_GROUP))
    except ValueError:
        pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.util.get_placement_group(PLACEMENT_GROUP)
            pg_left = True
        except ValueError:
            pg_left = False
        if not pg_left and not running_actors(namespace):
            return names
        time.sleep(0.2)
    raise TimeoutError(f"the old cluster did not go away in {timeout:.0f}s: {running_actors(namespace)}")
