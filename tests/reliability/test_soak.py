"""The CI soak, with the fault suite inside it: one multi-turn load (clients hanging up mid-stream
included) runs through this whole module on the shared real cluster.

1. One test per fault, in turn, while the load runs: in-flight clients get an answer or a clean error
   (HTTP 503, an SSE error event; for the ingress replica a closed connection), never a hang; the
   service is back within a generous bound (the measured figures are printed and recorded in
   RELIABILITY.md); afterwards no request gets a wrong token and every worker's invariants hold. A fault
   whose feature is not in this build skips with "needs <module>" until it lands.
2. The soak test: the load goes on (flushes quiesced and under load, EPLB rebalances when the actor
   exists) until it has run at least 2 minutes in all; then the load stops and every pool must be free
   after a flush, integrity holds everywhere, RSS grew less than the bound, and no greedy request of the
   whole run got a wrong token.

The long soak is ``make soak DURATION=30m`` (``python -m tests.reliability.soak``)."""
import json
import os
import tempfile

import pytest

from tests.reliability import checks
from tests.reliability.faults import FAULTS, Ctx, run_under_load
from tests.reliability.soak import SoakConfig, check_report, run_soak, start_load

# The real cluster under load: `make test` runs it, `make test-fast` does not. Its judge compares tokens
# with an offline engine's under the numerics policy.
pytestmark = [pytest.mark.slow, pytest.mark.numerics]

CFG = SoakConfig(duration_s=120.0, warmup_s=10.0, clients=4)

ORDER = ["corrupt_l3", "kill_prefill", "kill_decode", "kill_router", "kill_ingress",
         "kill_storage", "stop_mooncake_master", "slow_transfer", "eplb_rebalance"]
assert set(ORDER) == set(FAULTS), "every registered fault has a test"


@pytest.fixture(scope="module")
def load(rcluster):
    ld = start_load(rcluster, CFG)
    yield ld
    ld.stop()


@pytest.mark.parametrize("name", ORDER)
def test_fault_under_load(rcluster, reference, load, name):
    f = FAULTS[name]
    if not f.available():
        pytest.skip(f"needs {f.needs} (not in this build)")
    ctx = Ctx(rcluster, rcluster["url"], reference, rcluster["l3_dir"])
    print(json.dumps(run_under_load(ctx, name, load, recovery_bound_s=120.0)))
    checks.check_integrity(rcluster)


def test_soak_ci_two_minutes_of_mixed_load(rcluster, reference, load):
    rep = run_soak(rcluster, reference, CFG, rcluster["l3_dir"], load=load)
    # The whole report (wrong answers with their prompts included) for a failure to be replayed.
    path = os.path.join(os.environ.get("STRATA_HOME", tempfile.gettempdir()), "soak-ci-report.json")
    with open(path, "w") as f:
        json.dump(rep, f, default=str)
    print(f"soak report: {path}")
    print(json.dumps({k: rep[k] for k in ("load_seconds", "soak_phase_seconds", "requests", "counts", "events",
                                          "verified", "rss_anon_mib", "rss_growth_mib", "rss_growth_phase_mib")}))
    assert rep["load_seconds"] >= CFG.duration_s
    assert rep["events"]["flushes"] >= CFG.min_flushes and rep["events"]["hot_flushes"] >= CFG.min_hot_flushes
    # Wrong tokens included: a departure the judge does not explain (tests/reliability/judge.py) fails.
    bad = check_report(rep, CFG)
    assert not bad, bad
