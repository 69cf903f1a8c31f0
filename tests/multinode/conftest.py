"""A Ray cluster of 3 nodes on 127.0.0.1 (cluster/local_cluster.py) serving pd-2p1d: one worker per node."""
import dataclasses

import pytest

from cluster import launch  # sets the Ray environment (loopback, no token auth) on import
from cluster.config import load_config
from cluster.local_cluster import LocalCluster
from tests.util import free_port


def mn_config(tmp_path_factory, name: str = "pd-2p1d.yaml", **placement):
    cfg = load_config(f"cluster/configs/{name}")
    l3 = dataclasses.replace(cfg.engine.hicache.l3, path=str(tmp_path_factory.mktemp("l3")))
    engine = dataclasses.replace(cfg.engine, hicache=dataclasses.replace(cfg.engine.hicache, l3=l3))
    pc = dataclasses.replace(cfg.placement, **placement)
    # These tests follow requests across prefill nodes (a conversation moved, a node lost, scaled): none is
    # prefilled on the decode worker that holds it (conditional disaggregation: tests/e2e/test_cluster_http.py).
    return dataclasses.replace(cfg, engine=engine, server=dataclasses.replace(cfg.server, port=free_port()),
                               placement=pc, router=dataclasses.replace(cfg.router, local_prefill_tokens=0))


@pytest.fixture(scope="package")
def local_cluster():
    lc = LocalCluster(nodes=3, cpus=3)
    lc.connect()
    yield lc
    lc.shutdown()


@pytest.fixture(scope="module")
def mn(local_cluster, tmp_path_factory):
    """pd-2p1d deployed over the 3 nodes (placement: spread puts one worker on each), torn down after
    the module."""
    cfg = mn_config(tmp_path_factory, strategy="spread")
    handles = launch.deploy(cfg)
    yield {**handles, "lc": local_cluster, "cfg": cfg}
    launch.shutdown(handles)
