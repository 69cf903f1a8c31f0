"""A Ray cluster of several nodes on this one machine, all on 127.0.0.1: how tests and benches exercise
multi-node behaviour (placement, cross-node transfer, node loss) without more machines.

Each node is a real raylet with its own object store, started through ``ray.cluster_utils.Cluster``
(the programmatic form of ``ray start --address``). It stays with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
(cluster/launch.RAY_ENV): with it set to 1 Ray rewrites 127.0.0.1 into the machine's outward address
and binds its GCS there, so nodes would be reachable from beyond loopback -- ``ray start`` refuses a
second node under 0, the programmatic start does not.
"""
from __future__ import annotations

import os
import shutil
import tempfile

from cluster.launch import set_ray_env

set_ray_env()

import ray  # noqa: E402
from ray._private import ray_constants  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

LOOPBACK = "127.0.0.1"


class LocalCluster:
    """``nodes`` raylets (the head included), each declaring ``cpus`` logical CPUs and a resource
    ``strata_node_<i>`` naming it, so a test can pin an actor to node i."""

    def __init__(self, nodes: int = 3, cpus: float = 3, object_store_mb: int = 200,
                 namespace: str = "strata", temp_dir: str | None = None) -> None:
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        if ray_constants.ENABLE_RAY_CLUSTER:
            # Ray read the variable when it was first imported: then its nodes would bind the outward IP.
            raise RuntimeError("ray was imported before cluster.launch set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: "
                               "import cluster.launch (or set the variable) before ray")
        # Unix socket paths must stay short: a pytest tmp_path is too long for them.
        self.temp_dir = temp_dir or tempfile.mkdtemp(prefix="smn", dir="/tmp")
        self._own_tmp = temp_dir is None
        self.namespace = namespace
        self._opts = {"num_cpus": cpus, "node_ip_address": LOOPBACK,
                      "object_store_memory": object_store_mb * 1024 * 1024}
        self.cluster = Cluster(initialize_head=True, head_node_args={
            **self._opts, "include_dashboard": False, "temp_dir": self.temp_dir,
            "resources": {"strata_node_0": 1.0}})
        self.nodes = [self.cluster.head_node]
        for _ in range(nodes - 1):
            self.add_node()
        self.cluster.wait_for_nodes()

    @property
    def address(self) -> str:
        return self.cluster.address

    def connect(self) -> None:
        ray.init(address=self.address, namespace=self.namespace, _node_ip_address=LOOPBACK, log_to_driver=False)

    def add_node(self):
        node = self.cluster.add_node(**self._opts, resources={f"strata_node_{len(self.nodes)}": 1.0})
        self.nodes.append(node)
        return node

    def node_id(self, i: int) -> str:
        return self.nodes[i].node_id

    def index_of(self, node_id: str) -> int:
        return next(i for i, n in enumerate(self.nodes) if n is not None and n.node_id == node_id)

    def remove_node(self, i: int, graceful: bool = False) -> None:
        """Kill node ``i``'s raylet and everything it runs (as a machine that fails would)."""
        if i == 0:
            raise ValueError("the head node holds the GCS: removing it ends the cluster")
        self.cluster.remove_node(self.nodes[i], allow_graceful=graceful)
        self.nodes[i] = None

    def shutdown(self) -> None:
        if ray.is_initialized():
            ray.shutdown()
        self.cluster.shutdown()
        if self._own_tmp:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def pid_markers(lc: LocalCluster) -> tuple[str, ...]:
    """Command-line fragments naming this cluster's processes (tests check none is left behind)."""
    return (lc.temp_dir, os.path.basename(lc.temp_dir))
