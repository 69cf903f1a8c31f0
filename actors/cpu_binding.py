"""CPU binding: a worker whose engine runs on the CPU keeps its process on cores of its own, as vLLM's and
SGLang's CPU backends bind each rank's threads to a core set.

Why: on a machine where the engine shares its cores with everything else (the HTTP front, the ingress, the
router, Ray's daemons, the load itself), the scheduler moves the engine thread to whichever core woke it,
and the step starts with that core's caches holding someone else's data. Bound, 64 short requests at 16
in flight went from 139-183 to 199-253 req/s colocated, and from 106-129 to 158-188 req/s with 1P+1D, on 2
cores (README "Serving overhead", session 33); a cached prompt's TTFT and a 64-token request stayed within
the noise.

Which cores: a worker claims ``torch_threads`` cores of those this process may use, highest first (core 0
is where the kernel and everything unbound lands first), the least claimed first. A claim is an exclusive
``flock`` on one slot file per (core, slot) in a directory per user on this machine, so it needs no
coordinator, counts the workers of every strata cluster on the machine (several Ray nodes on one machine
share its cores), and ends with the process: a restarted worker claims again, and a dead one's cores are
free at once.
"""
from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger("strata.cpu_binding")

MODES = ("auto", "off")
CLAIMS_DIR = Path(tempfile.gettempdir()) / f"strata-cores-{os.getuid()}"


def cores_to_bind(mode: str, device: str, torch_threads: int, ep_size: int, usable: int) -> int:
    """How many cores a worker binds its process to (0: none). ``auto`` binds an engine on the CPU with a
    set number of intra-op threads (``torch_threads``, one core each) when this process may use more cores
    than that. Not on a GPU: there the worker's other threads (copies to the host, transfers) run beside
    the forward, and a core set would have to follow the GPU's NUMA node. Not an expert-parallel group's
    rank 0, whose other ranks are processes of their own."""
    if mode not in MODES:
        raise ValueError(f"workers.cpu_binding must be one of {MODES}, got {mode!r}")
    if mode == "off" or device != "cpu" or torch_threads < 1 or ep_size > 1 or usable <= torch_threads:
        return 0
    return torch_threads


class CoreClaim:
    """``n`` cores of ``usable`` claimed for this process until ``release`` (or its exit)."""

    def __init__(self, n: int, usable: Sequence[int], claims_dir: Path = CLAIMS_DIR) -> None:
        if n < 1 or n > len(set(usable)):
            raise ValueError(f"cannot claim {n} of the cores {sorted(set(usable))}")
        claims_dir.mkdir(mode=0o700, exist_ok=True)
        order = sorted(set(usable), reverse=True)
        self.cores: list[int] = []
        self._fds: list[int] = []
        slot = 0
        try:
            while len(self.cores) < n:   # slot k of every core before slot k+1 of any: the least claimed first
                for core in order:
                    if core not in self.cores and self._try(claims_dir / f"core{core}.slot{slot}"):
                        self.cores.append(core)
                        if len(self.cores) == n:
                            break
                slot += 1
        except BaseException:
            self.release()
            raise

    def _try(self, path: Path) -> bool:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fds.append(fd)
        return True

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)   # closing the only descriptor of the open file drops its flock
        self._fds, self.cores = [], []


def bind_process(cores: Sequence[int]) -> None:
    """Every thread of this process on ``cores``; threads started later inherit it from their starter."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:   # a thread that ended meanwhile
            pass


def bind_worker(mode: str, device: str, torch_threads: int, ep_size: int) -> CoreClaim | None:
    """Claim and bind per ``cores_to_bind``; None when it binds nothing. A claim that fails (no writable
    temporary directory, no affinity call on this platform) leaves the process unbound, with a warning:
    binding is an optimisation, not a condition of serving."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    usable = sorted(os.sched_getaffinity(0))
    n = cores_to_bind(mode, device, torch_threads, ep_size, len(usable))
    if n == 0:
        return None
    claim = None
    try:
        claim = CoreClaim(n, usable)
        bind_process(claim.cores)
    except OSError as e:
        log.warning("not binding this worker to cores: %s", e)
        if claim is not None:
            claim.release()
        return None
    return claim
