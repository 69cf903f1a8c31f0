"""One local Ray cluster for the transfer tests (actor pairs, then the HTTP cluster), started once."""
import os

import pytest

from cluster import launch  # sets the Ray environment (loopback, no token auth) on import
from cluster.config import load_config


@pytest.fixture(scope="package")
def ray_session():
    import ray
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "300")   # a busy shared box starts slowly
    launch.init_ray(load_config("cluster/configs/pd-1p1d-nixl.yaml"))
    yield
    ray.shutdown()
