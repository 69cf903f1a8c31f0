"""Start the cluster described by a YAML: router, workers (in a placement group), HTTP ingress; wait
until every worker reports. The entrypoint of

    ray job submit --working-dir . -- python -m cluster.launch --config cluster/configs/NAME.yaml --detach

and of ``strata serve`` (which starts a local Ray cluster first)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

RAY_ENV = {
    # Keep --node-ip-address=127.0.0.1 from being replaced, so nothing binds beyond loopback.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    # A ~/.ray/auth_token left by another tool would otherwise make every call fail InvalidAuthToken.
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def set_ray_env() -> None:
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)


set_ray_env()

import ray  # noqa: E402
from ray import serve  # noqa: E402

from actors.eplb import start_rebalancer  # noqa: E402
from actors.ingress import Ingress  # noqa: E402
from actors.router import PrefixRouterActor  # noqa: E402
from actors.storage import StorageActor  # noqa: E402
from cluster import workers as wk  # noqa: E402
from cluster.config import ClusterConfig, load_config, with_model  # noqa: E402
from engine.model.config import ModelConfig  # noqa: E402
from engine.model.loader import resolve_model_path  # noqa: E402
from storage.geometry import KVGeometry  # noqa: E402
from engine.engine import model_id  # noqa: E402


def init_ray(cfg: ClusterConfig, address: str | None = None) -> None:
    if ray.is_initialized():
        return
    address = address or cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace=cfg.ray.namespace, log_to_driver=False)
    else:
        start_local_ray(num_cpus=cfg.ray.num_cpus, namespace=cfg.ray.namespace)


def start_local_ray(attempts: int = 3, **kwargs) -> None:
    """``ray.init`` of a new loopback-only local cluster (kwargs: num_cpus, namespace, resources...).

    Ray gives a new raylet a fixed 30 s to register with its GCS; on a 2-core box whose cores are busy
    (a test suite, other jobs) that is sometimes too short, and a second start is the remedy."""
    # address="local": a new cluster even where an earlier `ray start` left its address behind (ray.init
    # would try to join that one, and refuse num_cpus, or hang on a dead one).
    kwargs = {"address": "local", "include_dashboard": False, "_node_ip_address": "127.0.0.1",
              "log_to_driver": False, **kwargs}
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


def deploy(cfg: ClusterConfig, detached: bool = False, ready_timeout: float = 120.0) -> dict:
    """Create router, workers and ingress; returns their handles once every worker has reported."""
    handles = start_actors(cfg, detached=detached, ready_timeout=ready_timeout)
    s = cfg.server
    # One HTTP proxy, on the launching node: Serve's default (one per node) would have every raylet of a
    # one-machine cluster bind the same host:port, and the server's address is the launching node's.
    serve.start(http_options={"host": s.host, "port": s.port}, proxy_location="HeadOnly")
    serve.run(ingress_app(cfg, handles), name="strata", route_prefix="/", blocking=False)
    return handles


def start_actors(cfg: ClusterConfig, detached: bool = False, ready_timeout: float = 120.0,
                 get_if_exists: bool = False) -> dict:
    """Create (or, with ``get_if_exists``, reuse) the named router and workers and wait until every
    worker has reported to the router. Reuse matters to a Serve application builder, which runs again
    on every redeploy of the same cluster."""
    path = resolve_model_path(cfg.engine.model)
    mc = ModelConfig.from_dir(path)
    geometry = KVGeometry.from_layers(mc.layer_types, mc.sliding_window, cfg.engine.page_size)
    engine_cfg = dataclasses.replace(cfg.engine, model=str(path)).resolved(mc.torch_dtype)
    life = {"lifetime": "detached"} if detached else {}
    # The configured namespace even when called from a task of another namespace (a Serve app builder).
    ns = cfg.ray.namespace
    hc = engine_cfg.hicache
    l3_model = model_id(path, mc, engine_cfg) if hc is not None and hc.l3 is not None else None
    router = PrefixRouterActor.options(name="strata-router", namespace=ns, num_cpus=0.1, get_if_exists=True,
                                       **wk.place_service(cfg, "router"), **life).remote(
        cfg.router, geometry, l3_model=l3_model)
    storage = _start_storage(cfg, router, life)
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
    eplb = (start_rebalancer(cfg.engine.eplb, workers, len(mc.moe_layer_ids), mc.num_local_experts, detached, ns)
            if cfg.engine.eplb is not None else None)
    s = cfg.server
    return {"router": router, "workers": workers, "engine_config": engine_cfg,
            "url": f"http://{s.host}:{s.port}", "model_path": str(path), "model_config": mc,
            "eplb": eplb, "storage": storage}


def ingress_app(cfg: ClusterConfig, handles: dict, ingress_cls=Ingress):
    """The bound HTTP ingress over the actors of ``start_actors`` (not yet running: ``serve.run`` it, or
    return it from a Serve application builder)."""
    s, mc = cfg.server, handles["model_config"]
    return serve.deployment(ingress_cls, name="ingress", num_replicas=1,
                            ray_actor_options={"num_cpus": s.num_cpus}).bind(
        handles["router"], handles["workers"], s.model_name, handles["model_path"], mc.vocab_size,
        mc.max_position_embeddings, s.request_timeout, s.max_inflight, cfg)


def _start_storage(cfg: ClusterConfig, router, life: dict):
    """The StorageActor owning the L3 service, when the engine has an L3 tier (else None)."""
    hc = cfg.engine.hicache
    if hc is None or hc.l3 is None or not cfg.storage.enabled:
        return None
    storage = StorageActor.options(name="strata-storage", namespace=cfg.ray.namespace, get_if_exists=True,
                                   num_cpus=cfg.storage.num_cpus, **wk.place_service(cfg, "storage"), **life).remote(hc.l3, cfg.storage, router)
    return storage


def shutdown(handles: dict | None = None) -> None:
    try:
        serve.shutdown()
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
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config)
        if args.model or args.served_model_name:
            cfg = with_model(cfg, args.model or cfg.engine.model, args.served_model_name)
        resolve_model_path(cfg.engine.model)     # a bad path is an error here, not in every worker
    except ValueError as e:
        print(f"strata: {e}", file=sys.stderr)
        return 2
    init_ray(cfg, args.address)
    handles = deploy(cfg, detached=args.detach)
    print(f"strata: serving {cfg.server.model_name} at {handles['url']} "
          f"({len(handles['workers'])} workers: {', '.join(handles['workers'])})", flush=True)
    print(f"strata: Ray at {ray.get_runtime_context().gcs_address} (namespace {cfg.ray.namespace})", flush=True)
    if args.detach:
        return 0
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        shutdown(handles)
    return 0


if __name__ == "__main__":
    sys.exit(main())
