"""The long soak's bookkeeping, no cluster: a fault that does not heal, fails its recovery check or
raises is recorded in the report and fails the run at the end instead of aborting it."""
from dataclasses import dataclass

from tests.reliability import soak
from tests.reliability.faults import FAULTS, Healed


@dataclass
class _Fault:
    inject: object


def _report(faults: list[dict]) -> dict:
    return {"hung": [], "wrong": [], "errors": [], "events": {"faults": faults}, "rss_growth_mib": {},
            "rss_growth_phase_mib": {}, "counts": {"ok": 5, "aborted": 1}}


def test_failed_faults_are_recorded_and_fail_the_report(monkeypatch):
    def lost(ctx):
        def after():
            raise AssertionError("the restarted router lost the L3 model id")
        return Healed("router", after=after)

    def raises(ctx):
        raise TimeoutError("the actor did not answer")

    calls = iter([False, False, False])
    monkeypatch.setitem(FAULTS, "_lost", _Fault(lost))
    monkeypatch.setitem(FAULTS, "_raises", _Fault(raises))
    monkeypatch.setitem(FAULTS, "_stuck", _Fault(lambda ctx: Healed("x", check=lambda: next(calls, False))))
    monkeypatch.setitem(FAULTS, "_fine", _Fault(lambda ctx: Healed("x", after=lambda: {"l3_serves_again_s": 1.0})))
    monkeypatch.setattr(soak.time, "sleep", lambda s: None)
    got = {n: soak._inject(n, None, bound_s=0.0) for n in ("_lost", "_raises", "_stuck", "_fine")}
    assert got["_lost"]["failed"] == "AssertionError: the restarted router lost the L3 model id"
    assert got["_raises"]["failed"].startswith("TimeoutError")
    assert got["_stuck"]["failed"] == "did not heal in 0s"
    assert "failed" not in got["_fine"] and got["_fine"]["l3_serves_again_s"] == 1.0
    cfg = soak.SoakConfig(faults=list(got))
    bad = soak.check_report(_report([{"fault": n, **r} for n, r in got.items()]), cfg)
    assert len(bad) == 1 and bad[0].startswith("3 faults did not recover")
    assert soak.check_report(_report([{"fault": "_fine", **got["_fine"]}]), cfg) == []
