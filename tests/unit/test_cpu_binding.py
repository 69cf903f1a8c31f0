"""actors/cpu_binding.py: which workers bind, the claims (highest core first, the least claimed first,
ended by their process's exit) and the binding of every thread of a process."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from actors.cpu_binding import CoreClaim, bind_process, bind_worker, cores_to_bind
from cluster.config import WorkersConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_auto_binds_a_cpu_engine_with_set_threads_when_there_are_cores_to_spare():
    assert cores_to_bind("auto", "cpu", 1, 1, 2) == 1
    assert cores_to_bind("auto", "cpu", 3, 1, 8) == 3
    assert cores_to_bind("off", "cpu", 1, 1, 8) == 0
    assert cores_to_bind("auto", "cuda", 1, 1, 8) == 0      # a GPU worker's copies and transfers run beside
    assert cores_to_bind("auto", "cpu", 0, 1, 8) == 0       # torch's default: every core
    assert cores_to_bind("auto", "cpu", 1, 2, 8) == 0       # an EP group's rank 0
    assert cores_to_bind("auto", "cpu", 2, 1, 2) == 0       # nothing left for the rest
    assert cores_to_bind("auto", "cpu", 1, 1, 1) == 0


def test_a_bad_mode_is_a_value_error_naming_the_field():
    with pytest.raises(ValueError, match="workers.cpu_binding"):
        WorkersConfig(cpu_binding="on")
    with pytest.raises(ValueError, match="workers.cpu_binding"):
        cores_to_bind("yes", "cpu", 1, 1, 2)
    assert WorkersConfig().cpu_binding == "auto"


def test_claims_take_the_highest_core_first_and_the_least_claimed_next(tmp_path):
    a, b, c, d = (CoreClaim(1, [0, 1, 2], tmp_path) for _ in range(4))
    assert [a.cores, b.cores, c.cores, d.cores] == [[2], [1], [0], [2]]
    b.release()
    e = CoreClaim(1, [2, 0, 1], tmp_path)
    assert e.cores == [1]
    f = CoreClaim(2, [0, 1, 2], tmp_path)     # slot 1 of 1 and of 0: the least claimed
    assert sorted(f.cores) == [0, 1]
    for x in (a, c, d, e, f):
        x.release()
    assert CoreClaim(2, [0, 1, 2], tmp_path).cores == [2, 1]
    with pytest.raises(ValueError, match="cannot claim 3"):
        CoreClaim(3, [4, 5], tmp_path)


def test_a_claim_ends_with_its_process(tmp_path):
    code = ("from pathlib import Path; from actors.cpu_binding import CoreClaim; "
            f"print(CoreClaim(1, [0, 1], Path({str(tmp_path)!r})).cores)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[1]"
    assert CoreClaim(1, [0, 1], tmp_path).cores == [1]   # not held by the process that exited


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_binding_covers_threads_started_before_and_after():
    code = textwrap.dedent("""
        import os, threading
        from actors.cpu_binding import bind_process
        core = max(os.sched_getaffinity(0))
        stop = threading.Event()
        before = threading.Thread(target=stop.wait); before.start()
        bind_process([core])
        after = threading.Thread(target=stop.wait); after.start()
        tids = os.listdir("/proc/self/task")
        affs = {tuple(os.sched_getaffinity(int(t))) for t in tids}
        stop.set(); before.join(); after.join()
        print(len(tids), affs == {(core,)})
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["3", "True"]


def test_bind_worker_binds_nothing_it_should_not():
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    assert bind_worker("off", "cpu", 1, 1) is None
    assert bind_worker("auto", "cuda", 1, 1) is None
    assert bind_worker("auto", "cpu", 0, 1) is None
    if before is not None:
        assert os.sched_getaffinity(0) == before

