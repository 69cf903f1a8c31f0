"""One real local Ray cluster (cluster/configs/reliability.yaml: 2 prefill + 1 decode workers, L3 in a
real mooncake_master run by the storage actor, the strata-eplb rebalancer; HTTP on a free port) shared by
every reliability test, and the offline reference engine.

``STRATA_RELIABILITY_CONFIG=cluster/configs/X.yaml`` runs the suite on another cluster YAML (a file L3
store goes to a temp dir the corrupt_l3 fault damages); it needs workers named prefill-0 and decode-0.
Faults whose target the YAML lacks (no eplb section, no mooncake L3) skip."""
import os

import pytest

from tests.reliability import harness


@pytest.fixture(scope="package")
def rcluster(tmp_path_factory):
    l3_dir = str(tmp_path_factory.mktemp("l3"))
    cfg = harness.cluster_config(l3_dir, os.environ.get("STRATA_RELIABILITY_CONFIG", harness.DEFAULT_CONFIG))
    handles = harness.start(cfg)
    yield {**handles, "cfg": cfg, "l3_dir": l3_dir}
    harness.stop(handles)


@pytest.fixture(scope="package")
def reference(rcluster):
    eng = harness.reference_engine(rcluster["cfg"], rcluster["model_path"])
    yield eng
    eng.close()
