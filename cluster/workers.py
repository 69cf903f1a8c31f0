"""Creating, finding and retiring the worker actors of a running cluster (the Ray side of placement.py):
used by ``launch.start_actors`` at deploy time and by ``strata scale`` while serving."""
from __future__ import annotations

import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.worker import WorkerActor, actor_name  # noqa: F401  (the name rule is the worker's: peers use it)
from cluster.lifecycle import ROUTER_ACTOR, STORAGE_ACTOR
from cluster.placement import NodeInfo, PlacementConfig, choose_node

ROLES = ("colocated", "prefill", "decode")


def nodes_now() -> list[NodeInfo]:
    """The cluster's nodes, the head first (placement ties go to it)."""
    out = []
    for n in ray.nodes():
        res = n.get("Resources", {})
        out.append(NodeInfo(n["NodeID"], bool(n.get("Alive")), dict(res), "node:__internal_head__" in res))
    return sorted(out, key=lambda n: (not n.is_head,))


def current_node() -> str:
    return ray.get_runtime_context().get_node_id()


def affinity(node_id: str | None, strategy: str):
    """The scheduling strategy for an actor bound to ``node_id`` (None: Ray's default scheduler)."""
    if node_id is None:
        return "DEFAULT"
    # soft: a restart after the node died goes to a surviving node instead of waiting forever
    return NodeAffinitySchedulingStrategy(node_id, soft=strategy != "strict_spread")


def need(cfg, role: str) -> dict[str, float]:
    """Custom resources a worker of ``role`` asks for: its placement role's plus the legacy
    ``workers.role_resources`` label."""
    return {**cfg.placement.resources(role), **cfg.workers.role_resource(role)}


def spawn(cfg, wid: str, role: str, engine_cfg, router, storage, workers_on: dict[str, int],
          life: dict, get_if_exists: bool = False):
    """Create worker ``wid`` on the node the placement policy picks; counts it in ``workers_on``."""
    w, pc = cfg.workers, cfg.placement
    node = choose_node(nodes_now(), workers_on, need(cfg, role), pc.strategy)
    if node is not None:
        workers_on[node] = workers_on.get(node, 0) + 1
    return WorkerActor.options(
        name=actor_name(wid), namespace=cfg.ray.namespace, get_if_exists=get_if_exists, num_cpus=w.num_cpus,
        num_gpus=w.num_gpus, resources=need(cfg, role), scheduling_strategy=affinity(node, pc.strategy), **life,
    ).remote(wid, role, engine_cfg, ROUTER_ACTOR if router is not None else None,
             transfer_cfg=cfg.transfer, storage=STORAGE_ACTOR if storage is not None else None, ep_size=w.ep_size,
             ep_num_cpus=w.num_cpus, ep_num_gpus=w.num_gpus, kv_events=cfg.kv_events,
             served_name=cfg.server.model_name, cpu_binding=w.cpu_binding)


def placed_on(workers: dict, timeout: float = 60.0) -> dict[str, str]:
    """worker id -> node id of running workers."""
    ids = list(workers)
    res = ray.get([workers[w].node.remote() for w in ids], timeout=timeout)
    return dict(zip(ids, res))


def counts(where: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for node in where.values():
        out[node] = out.get(node, 0) + 1
    return out


def wait_reported(router, worker_ids, timeout: float) -> None:
    """Until the router has a report from every one of ``worker_ids``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = ray.get(router.status.remote(), timeout=timeout)
        if set(st["workers"]) >= set(worker_ids):
            return
        time.sleep(0.1)
    raise TimeoutError(f"workers {sorted(set(worker_ids))} did not report to the router in {timeout:.0f}s")


def place_service(cfg, role: str, head: bool = True) -> dict:
    """Options placing the router or the storage actor: on a node with the role's resources, else the
    launching node (soft: it may move when that node dies)."""
    res = cfg.placement.resources(role)
    if res:
        return {"resources": res}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(current_node(), soft=True)} if head else {}
