"""One real local Ray cluster (2 prefill + 1 decode workers, the file L3 store in a temp dir, HTTP on a
free port) shared by every reliability test, and the offline reference engine.

``STRATA_RELIABILITY_CONFIG=cluster/configs/X.yaml`` runs the suite on another cluster YAML (one with an
EPLB section, or a mooncake L3, lets those faults run); it needs workers named prefill-0 and decode-0."""
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
