"""One local Ray cluster for the transfer tests (actor pairs, then the HTTP cluster), started once."""
import pytest

from cluster import launch  # sets the Ray environment (loopback, no token auth) on import
from cluster.config import load_config


@pytest.fixture(scope="package")
def ray_session():
    import ray
    launch.init_ray(load_config("cluster/configs/pd-1p1d-nixl.yaml"))
    yield
    ray.shutdown()
