"""actors/cpu_binding.py: which workers bind, the seats (the lowest free one, counted across processes,
ended with their process) and the cores they get: distinct while the seated workers fit the cores, none once
they do not, in real processes holding real flocks."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from actors.cpu_binding import Seats, bind_worker, cores_to_bind, seat_cores
from cluster.config import WorkersConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                              reason="needs CPU affinity and 2 usable cores")


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


def test_two_or_more_seats_get_distinct_cores_from_the_highest_while_they_fit():
    usable = [0, 1, 2, 3]
    assert [seat_cores(k, 4, 1, usable) for k in range(4)] == [[3], [2], [1], [0]]
    assert [seat_cores(k, 2, 2, usable) for k in range(2)] == [[3, 2], [1, 0]]
    assert seat_cores(0, 1, 1, usable) == [3]        # alone: the highest core too (session 45)
    assert seat_cores(0, 5, 1, usable) is None       # more workers than cores: every one unbound
    assert seat_cores(0, 3, 2, usable) is None
    assert seat_cores(4, 2, 1, usable) is None       # a seat past the cores waits until it moves down
    assert seat_cores(1, 2, 1, [5, 7]) == [5]


def test_seats_are_the_lowest_free_and_move_down(tmp_path):
    a, b, c = (Seats(tmp_path) for _ in range(3))
    assert [a.seat, b.seat, c.seat] == [0, 1, 2]
    assert a.seated() == b.seated() == c.seated() == 3
    a.release()
    assert b.seated() == 2
    c.take()
    assert c.seat == 0 and b.seated() == 2
    b.take()
    assert b.seat == 1      # nothing free below it
    for s in (b, c):
        s.release()


HOLDER = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from actors.cpu_binding import CoreBinding
    b = CoreBinding(1, [int(c) for c in sys.argv[2].split(",")], Path(sys.argv[1]))
    print(b.cores, flush=True)
    for line in sys.stdin:   # "refresh": look again, then say the cores and every thread's affinity
        if line.strip() == "close":
            b.close()
            b.refresh()
            print(b.seats.seat, b.seats.seated(), flush=True)
            continue
        cores = b.refresh()
        affs = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}
        print(cores, sorted(affs), flush=True)
""")


@affinity
def test_workers_bind_to_distinct_cores_and_unbind_when_outnumbering_them(tmp_path):
    two = sorted(os.sched_getaffinity(0))[:2]
    hi, lo = two[1], two[0]

    def start():
        p = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), f"{lo},{hi}"], cwd=ROOT, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        return p, p.stdout.readline().strip()

    def refresh(p):
        p.stdin.write("refresh\n")
        p.stdin.flush()
        return p.stdout.readline().strip()

    (p1, c1) = start()
    procs = [p1]
    try:
        assert c1 == f"[{hi}]"    # alone on the machine: the highest core
        p2, c2 = start()
        procs.append(p2)
        assert c2 == f"[{lo}]" and os.sched_getaffinity(p2.pid) == {lo}
        assert refresh(p1) == f"[{hi}] [({hi},)]"
        assert os.sched_getaffinity(p1.pid) == {hi}
        p3, c3 = start()          # a third worker on two cores: unbound, and so are the others once they look
        procs.append(p3)
        assert c3 == "None"
        assert refresh(p1) == f"None [({lo}, {hi})]"
        p2.kill()
        p2.wait()                 # its seat (1) ends with it; the third moves down to it
        assert refresh(p3) == f"[{lo}] [({lo},)]"
        assert refresh(p1) == f"[{hi}] [({hi},)]"
        p3.stdin.close()
        p3.wait()
        assert refresh(p1) == f"[{hi}] [({hi},)]"   # alone again: its core kept
        p1.stdin.write("close\n")
        p1.stdin.flush()
        assert p1.stdout.readline().strip() == "None 0"   # closed: its seat given up, none taken again
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_bind_worker_binds_nothing_it_should_not():
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    assert bind_worker("off", "cpu", 1, 1) is None
    assert bind_worker("auto", "cuda", 1, 1) is None
    assert bind_worker("auto", "cpu", 0, 1) is None
    if before is not None:
        assert os.sched_getaffinity(0) == before
