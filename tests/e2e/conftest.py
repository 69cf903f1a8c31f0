"""A real local Ray cluster with the 2 prefill + 1 decode configuration, served on a free port."""
import dataclasses

import pytest

from cluster import launch  # sets the Ray environment (loopback, no token auth) on import
from cluster.config import load_config
from tests.util import free_port


@pytest.fixture(scope="package")
def cluster(tmp_path_factory):
    import ray
    cfg = load_config("cluster/configs/pd-2p1d.yaml")
    l3 = dataclasses.replace(cfg.engine.hicache.l3, path=str(tmp_path_factory.mktemp("l3")))
    engine = dataclasses.replace(cfg.engine, hicache=dataclasses.replace(cfg.engine.hicache, l3=l3))
    # A replay buffer far smaller than what the workers publish over the package: a consumer that joins
    # late (a restarted router, test_router_restart.py) must rebuild from snapshots, not from the replay.
    cfg = dataclasses.replace(cfg, engine=engine, server=dataclasses.replace(cfg.server, port=free_port()),
                              kv_events=dataclasses.replace(cfg.kv_events, buffer_batches=32))
    launch.init_ray(cfg)
    handles = launch.deploy(cfg)
    yield handles
    launch.shutdown(handles)
    ray.shutdown()
