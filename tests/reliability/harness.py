"""Start and stop the real local cluster the reliability tests and the soak run against, and build the
offline reference engine their outputs are compared with."""
from __future__ import annotations

import dataclasses

from cluster import launch  # sets the Ray environment (loopback, no token auth) on import
from cluster.config import ClusterConfig, load_config
from tests.util import free_port

# 2 prefill + 1 decode (a prefill worker can die), L3 in mooncake_master, EPLB: every fault has a target.
DEFAULT_CONFIG = "cluster/configs/reliability.yaml"


def cluster_config(l3_dir: str, config: str = DEFAULT_CONFIG, port: int | None = None) -> ClusterConfig:
    """``config`` with a file L3 store in ``l3_dir`` (the tests corrupt it), a Mooncake L3 master on a
    free port, and a free HTTP port."""
    cfg = load_config(config)
    hc = cfg.engine.hicache
    if hc is not None and hc.l3 is not None:
        l3 = dataclasses.replace(hc.l3, path=l3_dir)
        if l3.backend == "mooncake":
            l3 = dataclasses.replace(l3, mooncake=dataclasses.replace(l3.mooncake,
                                                                      master_addr=f"127.0.0.1:{free_port()}"))
        cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, hicache=dataclasses.replace(hc, l3=l3)))
    # Every worker checks its invariants after each step and command (engine/async_engine.py): a page
    # owned twice for a moment is caught when it happens, not only if it lasts until the next check.
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, debug_integrity=True))
    return dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, port=port or free_port()))


def start(cfg: ClusterConfig) -> dict:
    launch.init_ray(cfg)   # retries a Ray start that misses its window on a busy box
    return {**launch.deploy(cfg, ready_timeout=300.0), "cfg": cfg}


def stop(handles: dict | None) -> None:
    import ray
    launch.shutdown(handles)
    ray.shutdown()


def reference_engine(cfg: ClusterConfig, model_path: str):
    """The oracle: the same model and engine configuration, offline, in this process, with no L2, no L3
    and no disaggregation. Its L1 prefix cache stays on: the soak's conversations share long prefixes,
    and recomputing each from scratch would take minutes (tokens do not depend on caching: DESIGN's
    invariant, proven against transformers by tests/unit)."""
    from engine import Engine
    ecfg = dataclasses.replace(cfg.engine, model=model_path, enable_prefix_cache=True, hicache=None)
    return Engine(ecfg)
