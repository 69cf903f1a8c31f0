"""Start the cluster described by a YAML: router, workers (in a placement group), HTTP ingress; wait
until every worker reports. The entrypoint of

    ray job submit --working-dir . -- python -m cluster.launch --config cluster/configs/NAME.yaml --detach

and of ``strata serve`` (which starts a local Ray cluster first)."""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import sys
import time

from cluster.front import check_haproxy, front_is_set, set_front_env  # no Ray in it: before the first import ray

RAY_ENV = {
    # Keep --node-ip-address=127.0.0.1 from being replaced, so nothing binds beyond loopback.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    # A ~/.ray/auth_token left by another tool would otherwise make every call fail InvalidAuthToken.
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    # Serve's proxy answers 503 "starting", not 404, between opening the port and knowing strata's route
    # (server.front serve_proxy; with haproxy, the fallback proxy Serve keeps beside HAProxy and the ingress
    # replica's own HTTP server load it too, where it changes nothing).
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "actors.lifecycle:proxy_middlewares",
    # The ingress replica runs strata's HTTP app on its own event loop, not on a second loop in a second
    # thread (Ray Serve's default, and what RAY_SERVE_THROUGHPUT_OPTIMIZED turns off): every request and
    # every item crossed between the two threads, ~12% of the ingress's CPU per request (bench/overhead.py).
    # The app never blocks its loop (no ray.get; Ray calls are awaited), so Serve's own work there is not held.
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
}


def set_ray_env() -> None:
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    if not front_is_set():
        # The default front for a cluster started without a config (LocalCluster, tests); a launch sets
        # the configured one again before it starts Ray. Checked there, not on every import.
        set_front_env("haproxy", check=False)


set_ray_env()

import ray  # noqa: E402
from ray import serve  # noqa: E402

from actors.ingress import Ingress  # noqa: E402
from actors.lifecycle import StartingIngress  # noqa: E402
from actors.router import PrefixRouterActor  # noqa: E402
from actors.storage import StorageActor  # noqa: E402
from cluster import workers as wk  # noqa: E402
from cluster.config import IF_EXISTS, ClusterConfig, load_config, with_model  # noqa: E402
from cluster.lifecycle import (APP_NAME, ROUTER_ACTOR, STORAGE_ACTOR, Signals, app_phase, drain,  # noqa: E402
                               running_actors, tear_down)
from engine.config import model_id  # noqa: E402
from engine.model.config import ModelConfig  # noqa: E402
from engine.model.checkpoint import resolve_model_path  # noqa: E402
from storage.geometry import KVGeometry  # noqa: E402


def init_ray(cfg: ClusterConfig, address: str | None = None) -> None:
    if ray.is_initialized():
        return
    address = address or cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        # The front of a cluster we join is the one its nodes were started with (front_env).
        ray.init(address=address, namespace=cfg.ray.namespace, log_to_driver=False)
    else:
        start_local_ray(num_cpus=cfg.ray.num_cpus, namespace=cfg.ray.namespace, front=cfg.server.front)


def start_local_ray(attempts: int = 3, front: str = "haproxy", **kwargs) -> None:
    """``ray.init`` of a new loopback-only local cluster (kwargs: num_cpus, namespace, resources...) whose
    Serve runs the HTTP front ``front`` (ServerConfig.front).

    Ray gives a new raylet a fixed 30 s to register with its GCS; on a 2-core box whose cores are busy
    (a test suite, other jobs) that is sometimes too short, and a second start is the remedy."""
    # address="local": a new cluster even where an earlier `ray start` left its address behind (ray.init
    # would try to join that one, and refuse num_cpus, or hang on a dead one).
    kwargs = {"address": "local", "include_dashboard": False, "_node_ip_address": "127.0.0.1",
              "log_to_driver": False, **kwargs}
    set_front_env(front)
    for i in range(attempts):
        try:
            ray.init(**kwargs)
            return
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
            ray.shutdown()
            if "timed out during startup" not in str(e) or i == attempts - 1:
                raise
            print(f"strata: Ray did not start in time (attempt {i + 1}/{attempts}); retrying", file=sys.stderr)
            time.sleep(5)


def deploy(cfg: ClusterConfig, detached: bool = False, ready_timeout: float = 120.0,
           placeholder: bool = False) -> dict:
    """Create router, workers and ingress; returns their handles once the ingress serves. With
    ``placeholder`` (what ``strata serve`` and the RayJob do) the port answers 503 "starting"
    (lifecycle.StartingIngress) while the workers load, and the ingress replaces that placeholder; a
    caller that only talks to the returned cluster (tests, benches) skips it and its rolling update."""
    if placeholder:
        start_serve(cfg)
    else:
        start_proxy(cfg)
    handles = start_actors(cfg, detached=detached, ready_timeout=ready_timeout)
    run_app(ingress_app(cfg, handles, beside_proxy=True))
    wait_serving(cfg, ready_timeout)
    return handles


def wait_serving(cfg: ClusterConfig, timeout: float = 60.0) -> bool:
    """Until GET /health on the server's port answers 200, i.e. the front routes to the ingress: HAProxy
    learns a new replica with its next reload (a fraction of a second after Serve reports it), and until
    then it answers 503 "starting" where Serve's proxy used to hold the request. False (and a note) if
    it does not within ``timeout`` s, or if this process cannot reach the port."""
    import urllib.error
    import urllib.request
    s = cfg.server
    host = "127.0.0.1" if s.host in ("0.0.0.0", "::", "") else s.host
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{host}:{s.port}/health", timeout=5) as r:
                if r.status == 200:
                    return True
        except urllib.error.HTTPError as e:
            last = f"{e.code}"
        except OSError as e:
            last = f"{type(e).__name__}"
        time.sleep(0.05)
    print(f"strata: http://{host}:{s.port}/health did not answer 200 in {timeout:g}s (last: {last})",
          file=sys.stderr, flush=True)
    return False


def start_serve(cfg: ClusterConfig) -> None:
    """Start Serve's HTTP proxy and, unless the app already exists, put the placeholder on its route.
    Waits until the placeholder runs before the workers start loading: the proxy holds a request between
    learning the route and learning its replica, and that wait is ~2 s alone but 5-7 s on a busy box."""
    s = cfg.server
    start_proxy(cfg)
    if app_phase(APP_NAME) is not None:
        return
    # It answers at once, so its stop need not wait Serve's default 2 s loop / 20 s timeout.
    app = serve.deployment(StartingIngress, name="ingress", num_replicas=1,
                           ray_actor_options={"num_cpus": 0, **BESIDE_THE_PROXY},
                           graceful_shutdown_wait_loop_s=0.1, graceful_shutdown_timeout_s=1,
                           **ingress_options(s)).bind()
    run_app(app, wait_running=True)


def start_proxy(cfg: ClusterConfig) -> None:
    s = cfg.server
    # One HTTP proxy, on the launching node: Serve's default (one per node) would have every raylet of a
    # one-machine cluster bind the same host:port, and the server's address is the launching node's.
    serve.start(http_options={"host": s.host, "port": s.port}, proxy_location="HeadOnly")


def run_app(app, wait_running: bool = False) -> None:
    """``serve.run(app, name=APP_NAME, route_prefix="/")`` without the ``serve.start`` inside it: Serve was
    started once, by ``start_proxy`` with strata's HTTP options, and every further start only logs
    "Connecting to existing Serve app ... New http_options will not be applied" (twice per launch: the
    placeholder, then the ingress). Deploys through the running controller, as serve.run does after
    its start."""
    from ray.serve._private.build_app import build_app
    from ray.serve.context import _get_global_client
    built = build_app(app, name=APP_NAME, route_prefix="/",
                      default_runtime_env=ray.get_runtime_context().runtime_env)
    _get_global_client().deploy_applications([built], wait_for_ingress_deployment_creation=True,
                                             wait_for_applications_running=wait_running)


def ingress_replicas(app: str = APP_NAME, deployment: str = "ingress") -> dict[str, str]:
    """replica id -> state of ``deployment``'s replicas ({} where there is none)."""
    from ray.serve.context import _get_global_client
    try:
        d = _get_global_client().get_serve_details()["applications"][app]["deployments"][deployment]
    except (KeyError, TypeError):
        return {}
    return {r["replica_id"]: str(r["state"]) for r in d.get("replicas", [])}


def wait_replaced(old: set[str], timeout: float = 60.0, app: str = APP_NAME, deployment: str = "ingress") -> None:
    """Until none of the replicas ``old`` (the placeholder's, from ``ingress_replicas`` before the ingress
    was deployed) is left and the new ones run: a replica being replaced stays reachable a moment after its
    successor is up (HAProxy drops it with its next reload, Serve's proxy with its next routing update),
    and what is sent there gets 503 "starting". Gives up (and says so) after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    now: dict = {}
    while time.monotonic() < deadline:
        now = ingress_replicas(app, deployment)
        if now and not set(now) & old and all(st.endswith("RUNNING") for st in now.values()):
            return
        time.sleep(0.1)
    print(f"strata: the ingress's rolling update was not over in {timeout:g}s ({now})", file=sys.stderr,
          flush=True)


def ingress_options(s) -> dict:
    """Serve options of the ingress deployment (and of the placeholder it replaces)."""
    # Serve's default (5 ongoing requests a replica) would queue the 6th stream in the proxy, out of
    # reach of max_inflight's 503 and of the drain's "shutting down"; a few more for health and drain calls.
    opts = {"max_ongoing_requests": s.max_inflight + 8,
            "logging_config": {"enable_access_log": s.access_log}}   # server.access_log (cluster/config.py)
    # Start the new replica before stopping the old one (placeholder -> ingress, redeploys): no window
    # with no replica, where the proxy would hold requests. Ray >= 2.60 only.
    if "max_surge_percent" in inspect.signature(serve.deployment).parameters:
        opts["max_surge_percent"] = 100
    return opts


def start_actors(cfg: ClusterConfig, detached: bool = False, ready_timeout: float = 120.0,
                 get_if_exists: bool = False) -> dict:
    """Create (or, with ``get_if_exists``, reuse) the named router and workers and wait until every
    worker has reported to the router. Reuse matters to a Serve application builder, which runs again
    on every redeploy of the same cluster."""
    path = resolve_model_path(cfg.engine.model)
    mc = ModelConfig.from_dir(path)
    cfg.check_model(mc.num_local_experts if mc.moe_layer_ids else 0)
    geometry = KVGeometry.from_layers(mc.layer_types, mc.sliding_window, cfg.engine.page_size)
    engine_cfg = dataclasses.replace(cfg.engine, model=str(path)).resolved(mc.torch_dtype)
    life = {"lifetime": "detached"} if detached else {}
    # The configured namespace even when called from a task of another namespace (a Serve app builder).
    ns = cfg.ray.namespace
    hc = engine_cfg.hicache
    l3_model = model_id(path, mc, engine_cfg) if hc is not None and hc.l3 is not None else None
    # The router's route channel binds where the workers' token channels do (the KV events' host, or auto).
    router = PrefixRouterActor.options(name=ROUTER_ACTOR, namespace=ns, num_cpus=0.1, get_if_exists=True,
                                       **wk.place_service(cfg, "router"), **life).remote(
        cfg.router, geometry, storage=STORAGE_ACTOR if l3_model else None,
        host=None if cfg.kv_events.host == "auto" else cfg.kv_events.host)
    storage = _start_storage(cfg, life, l3_model, (geometry.page_size, geometry.window or 0))
    if storage is not None:   # workers open L3 with the storage actor's connection info
        l3 = ray.get(storage.worker_config.remote(), timeout=ready_timeout)
        engine_cfg = dataclasses.replace(engine_cfg, hicache=dataclasses.replace(engine_cfg.hicache, l3=l3))
    roles = ([("colocated", i) for i in range(cfg.workers.colocated)]
             + [("prefill", i) for i in range(cfg.workers.prefill)]
             + [("decode", i) for i in range(cfg.workers.decode)])
    # Each worker on the node the placement policy picks (cluster/placement.py), counting those that
    # already run (a Serve app builder or an adopting job finds them by name).
    workers, on = {}, {}
    for role, n in roles:
        wid = f"{role}-{n}"
        workers[wid] = wk.spawn(cfg, wid, role, engine_cfg, router, storage, on, life, get_if_exists)
    ray.get([a.start.remote() for a in workers.values()], timeout=ready_timeout)
    if storage is not None:
        storage.attach.remote(workers)
    wk.wait_reported(router, workers, ready_timeout)
    eplb = None
    if cfg.engine.eplb is not None:
        from actors.eplb_actor import start_rebalancer
        eplb = start_rebalancer(cfg.engine.eplb, workers, len(mc.moe_layer_ids), mc.num_local_experts, detached, ns,
                                router=ROUTER_ACTOR)
    s = cfg.server
    return {"router": router, "workers": workers, "engine_config": engine_cfg,
            "url": f"http://{s.host}:{s.port}", "model_path": str(path), "model_config": mc,
            "eplb": eplb, "storage": storage}


# The ingress replica on the head node, where ``start_proxy`` runs the one HTTP front (HeadOnly): HAProxy
# hands each connection to it there, and a worker node that is lost does not take the ingress with it (a
# replica lost mid-request leaves HAProxy nothing to answer with but a 502 or a closed connection).
BESIDE_THE_PROXY = {"resources": {"node:__internal_head__": 0.001}}


def ingress_app(cfg: ClusterConfig, handles: dict, ingress_cls=Ingress, beside_proxy: bool = False):
    """The bound HTTP ingress over the actors of ``start_actors`` (not yet running: ``serve.run`` it, or
    return it from a Serve application builder). ``beside_proxy``: on the head node, with the HeadOnly
    front of strata's own launches (a RayService's proxies run on every node: its replicas go anywhere)."""
    s, mc = cfg.server, handles["model_config"]
    opts = {"num_cpus": s.num_cpus, **(BESIDE_THE_PROXY if beside_proxy else {})}
    return serve.deployment(ingress_cls, name="ingress", num_replicas=1,
                            ray_actor_options=opts, **ingress_options(s)).bind(
        handles["router"], handles["workers"], s.model_name, handles["model_path"], mc.vocab_size,
        mc.max_position_embeddings, s.request_timeout, s.max_inflight, cfg)


def _start_storage(cfg: ClusterConfig, life: dict, l3_model: str | None = None, geometry: tuple[int, int] = (0, 0)):
    """The StorageActor owning the L3 service, when the engine has an L3 tier (else None); ``l3_model`` and
    ``geometry`` (page size, window in tokens) name its pages on the KV-event wire."""
    hc = cfg.engine.hicache
    if hc is None or hc.l3 is None or not cfg.storage.enabled:
        return None
    ns = cfg.ray.namespace
    return StorageActor.options(name=STORAGE_ACTOR, namespace=ns, get_if_exists=True,
                                num_cpus=cfg.storage.num_cpus, **wk.place_service(cfg, "storage"), **life).remote(
        hc.l3, cfg.storage, ROUTER_ACTOR, ns, kv_events=cfg.kv_events, l3_model=l3_model,
        served_name=cfg.server.model_name, geometry=geometry)


def shutdown(handles: dict | None = None, serve_too: bool = True) -> None:
    """Stop Serve (``serve_too``; else delete only strata's app: Serve on a cluster we joined may run
    other apps) and kill the actors in ``handles``."""
    try:
        if serve_too:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
    except Exception:
        pass
    if handles:
        for a in list(_all_workers(handles).values()) + [handles["router"]]:
            ray.kill(a, no_restart=True)
        if handles.get("eplb") is not None:
            ray.kill(handles["eplb"], no_restart=True)
        if handles.get("storage") is not None:
            try:
                ray.get(handles["storage"].shutdown.remote(), timeout=30)   # stops the master it started
            except Exception:
                pass
            ray.kill(handles["storage"], no_restart=True)


def _all_workers(handles: dict) -> dict:
    """The workers deployed, plus any that ``strata scale`` added since (detached: found by name)."""
    out = dict(handles["workers"])
    try:
        st = ray.get(handles["router"].status.remote(), timeout=10)
        ns = ray.get_runtime_context().namespace
        for w in set(st["workers"]) - set(out):
            try:
                out[w] = ray.get_actor(wk.actor_name(w), namespace=ns)
            except ValueError:
                pass
    except Exception:  # noqa: BLE001 - a dead router: the deployed ones are what we know
        pass
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cluster.launch")
    ap.add_argument("--config", default=None, help="cluster YAML (default: the embedded default)")
    ap.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS, else a local cluster)")
    ap.add_argument("--detach", action="store_true", help="deploy detached actors and exit (ray job submit)")
    ap.add_argument("--model", default=None, help="a checkpoint directory (or strata-tiny) instead of the YAML's")
    ap.add_argument("--served-model-name", default=None, help="the name clients send as `model`")
    ap.add_argument("--if-exists", choices=IF_EXISTS, default=None,
                    help="a strata cluster already runs in the namespace: adopt it (keep what runs, start "
                         "what is missing), replace it (drain, tear down, deploy anew) or fail "
                         "(default: the YAML's ray.if_exists, adopt)")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config)
        if args.model or args.served_model_name:
            cfg = with_model(cfg, args.model or cfg.engine.model, args.served_model_name)
        resolve_model_path(cfg.engine.model)     # a bad path is an error here, not in every worker
        if cfg.server.front == "haproxy" and not (args.address or cfg.ray.address or os.environ.get("RAY_ADDRESS")):
            check_haproxy()     # the cluster this launch starts runs it (a joined one: its nodes do)
    except ValueError as e:
        print(f"strata: {e}", file=sys.stderr)
        return 2
    if_exists = args.if_exists or cfg.ray.if_exists
    # Only a cluster this process starts is stopped on the way out, never one it joined.
    own_ray = not (ray.is_initialized() or args.address or cfg.ray.address or os.environ.get("RAY_ADDRESS"))
    signals = Signals().install()
    handles, owned, keep = None, True, False
    phases = Phases()
    try:
        init_ray(cfg, args.address)
        phases.mark("ray")
        signals.install()       # again: ray.init put its own SIGTERM handler (exit on the spot) in place
        try:
            handles, owned = _deploy_or_adopt(cfg, args.detach, if_exists, signals, phases)
        except FileExistsError as e:
            print(f"strata: {e}", file=sys.stderr, flush=True)
            owned = False
            return 3
        print(f"strata: Ray at {ray.get_runtime_context().gcs_address} (namespace {cfg.ray.namespace})",
              flush=True)
        if args.detach:
            keep = True
            return 0
        name = signals.wait()
        if owned:
            _drain(cfg, signals, name)
    except KeyboardInterrupt:    # Stopped, or what Ray's blocking calls make of it
        name = signals.received[-1] if signals.received else "interrupted"
        print(f"strata: {name}: stopped while starting", file=sys.stderr, flush=True)
    finally:
        signals.starting = False    # whatever comes now only counts; the cleanup runs to its end
        if not keep:
            _stop(handles if owned else None, own_ray, owned, signals.hurry)
    return 0


class Phases:
    """Where a start's seconds go (bench/startup.py reads the ``strata: start-up`` line it makes)."""

    def __init__(self) -> None:
        self.t0 = self.last = time.monotonic()
        self.spent: dict[str, float] = {}

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.spent[name] = now - self.last
        self.last = now

    def report(self) -> str:
        return f"{self.last - self.t0:.1f}s: " + ", ".join(f"{k} {v:.1f}s" for k, v in self.spent.items())


def _drain(cfg: ClusterConfig, signals: Signals, name: str) -> None:
    print(f"strata: {name}: draining (new requests get 503; up to {cfg.server.drain_timeout:g}s for those in "
          "flight; signal again to stop now)", file=sys.stderr, flush=True)
    left, secs = drain(cfg.server.drain_timeout, lambda: signals.hurry)
    print(f"strata: drained in {secs:.1f}s" + (f" ({left} requests cut)" if left else ""),
          file=sys.stderr, flush=True)


def _deploy_or_adopt(cfg: ClusterConfig, detached: bool, if_exists: str,
                     signals: Signals, phases: Phases | None = None) -> tuple[dict | None, bool]:
    """Deploy, minding a strata cluster already running in the namespace. Returns (handles, owned):
    owned is False for an adopted cluster, which this launch leaves running (handles None where even
    the app was kept). ``fail`` raises FileExistsError."""
    ns = cfg.ray.namespace
    existing = running_actors(ns)
    if existing and if_exists == "fail":
        raise FileExistsError(f"a strata cluster already runs in namespace {ns!r} ({', '.join(existing)}); "
                              "pass --if-exists adopt or replace")
    if existing and if_exists == "replace":
        killed = tear_down(ns, cfg.server.drain_timeout)
        print(f"strata: replaced the running cluster ({', '.join(killed)})", flush=True)
        existing = []
    s = cfg.server
    if existing:
        phase = app_phase(APP_NAME)
        if phase == "ready":
            print(f"strata: serving {s.model_name} at http://{s.host}:{s.port} (adopted the running cluster: "
                  f"{', '.join(existing)}; its actors keep the config they were started with: "
                  "--if-exists replace applies this one)", flush=True)
            return None, False
        print(f"strata: adopting the running actors ({', '.join(existing)}); the app was {phase or 'absent'}",
              flush=True)
    phases = phases or Phases()
    start_serve(cfg)
    phases.mark("serve")
    handles = start_actors(cfg, detached=detached, get_if_exists=bool(existing))
    phases.mark("actors")
    # From here a signal waits for the ingress (seconds) and drains it: it may already be answering.
    signals.starting = False
    old = set(ingress_replicas())
    run_app(ingress_app(cfg, handles, beside_proxy=True))
    wait_replaced(old)
    wait_serving(cfg, 30.0)
    phases.mark("ingress")
    print(f"strata: start-up {phases.report()}", flush=True)
    owned = not existing
    print(f"strata: serving {s.model_name} at {handles['url']} "
          f"({len(handles['workers'])} workers: {', '.join(handles['workers'])})", flush=True)
    return handles, owned


def _stop(handles: dict | None, own_ray: bool, owned: bool, hurry: bool = False) -> None:
    """Strata's app and actors (when this launch made them), then the local Ray cluster it started."""
    if owned and ray.is_initialized() and not (hurry and own_ray):   # in a hurry, ray.shutdown ends them all
        # Only the app, not serve.shutdown(): Serve may run other apps on a cluster we joined, and on our
        # own the controller's self-kill makes the raylet print a failed-task warning; ray.shutdown ends it.
        shutdown(handles, serve_too=False)
    if own_ray:
        # Even when a signal cut ray.init short: it ends whatever node processes were started.
        # wait_for_processes: return only once the GCS, raylet and workers are gone, so that nothing of
        # this cluster outlives the command.
        ray.shutdown(wait_for_processes=True)
    elif ray.is_initialized():
        ray.shutdown()
    print("strata: stopped", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
