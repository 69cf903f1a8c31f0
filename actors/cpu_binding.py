"""CPU binding: workers whose engines run on the CPU keep their processes on cores of their own (one alone on
its machine too), as vLLM's and SGLang's CPU backends bind each rank's threads to a core set.

Why: with two engines on one machine the scheduler, placing each thread beside whichever thread woke it,
often stacks both engine threads on one core while another idles. Bound, 1P+1D on 2 cores did better in
paired rounds (the binding switched on and off every few seconds on one server, 30 pairs): cached TTFT
p50 -0.5 ms (19 of 30), the workers' CPU per request -0.17 ms (21 of 30), 64 short requests at 16 in flight
+8 req/s (18 of 30). A worker alone on its machine binds too (session 45): unbound, the OS moves its engine
thread between the cores and beside the ingress, and its 64-token request took 1.03-1.34x (median 1.14) an
engine's by turns in the bench's process (bench/overhead.py ``by_turns``), bound 1.03-1.10x (median 1.05):
better in 6 of 8 pairs of alternated servers, the cached TTFT's gap over the engine 4.15 against 4.65 ms (medians).
Session 33's rounds, which switched a running server's binding, had found no TTFT gain for it.

Which cores: every worker that may bind holds a *seat* on its machine, an exclusive ``flock`` on the file
``seat<k>`` (the lowest k free) in a directory per user. Seats count the workers of every strata cluster on
the machine (several Ray nodes on one machine share its cores) with no coordinator, and a seat ends with its
process. While the seated workers (one alone too) fit the cores a process may use (``torch_threads`` each),
seat k binds to the k-th group of cores counted from the highest (core 0 is where the kernel and everything
unbound land first). When they outnumber the cores, every one of them is unbound and the OS places them: two
workers bound to one core, and a third beside two bound ones, each measured worse than three workers placed
by the OS on two cores (2P+1D: TTFT and the 64-token request worse in 3 of 3 alternating pairs either way).
Each worker looks again every second on a thread of its own (``CoreBinding.refresh``): a worker started or
ended elsewhere changes the count, and a seat freed below one's own is taken, so seats stay 0..n-1 and
cores distinct.
"""
from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger("strata.cpu_binding")

MODES = ("auto", "off")
SEATS_DIR = Path(tempfile.gettempdir()) / f"strata-cores-{os.getuid()}"
REFRESH_S = 1.0


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


def seat_cores(seat: int, seated: int, per_worker: int, usable: Sequence[int]) -> list[int] | None:
    """The cores of the worker in ``seat`` while ``seated`` workers hold seats, each binding ``per_worker``
    of ``usable``; None: unbound (more workers than cores, or a seat past them until it moves down)."""
    order = sorted(set(usable), reverse=True)
    if seated * per_worker > len(order) or (seat + 1) * per_worker > len(order):
        return None
    return order[seat * per_worker:(seat + 1) * per_worker]


class Seats:
    """This process's seat among the files ``seat<k>`` of ``directory``, and the count of those held."""

    def __init__(self, directory: Path = SEATS_DIR) -> None:
        directory.mkdir(mode=0o700, exist_ok=True)
        self.dir = directory
        self.seat: int | None = None
        self._fd: int | None = None
        self.take()

    def _lock(self, k: int) -> int | None:
        fd = os.open(self.dir / f"seat{k}", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def take(self) -> None:
        """The lowest free seat, if below the one held (or none is held yet)."""
        k = 0
        while self.seat is None or k < self.seat:
            fd = self._lock(k)
            if fd is not None:
                if self._fd is not None:
                    os.close(self._fd)   # its only descriptor: closing it drops the flock
                self.seat, self._fd = k, fd
                return
            k += 1

    def seated(self) -> int:
        """Seats held on this machine now, this one's included."""
        return held_seats(self.dir, self.seat)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self.seat, self._fd = None, None


def held_seats(directory: Path = SEATS_DIR, own: int | None = None) -> int:
    """How many seats of ``directory`` are held now (``own``: this process's, counted without a probe)."""
    n = 0
    for name in os.listdir(directory) if directory.is_dir() else ():
        if not (name.startswith("seat") and name[4:].isdigit()):
            continue
        k = int(name[4:])
        if k == own:
            n += 1
            continue
        try:
            fd = os.open(directory / name, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            n += 1
        finally:
            os.close(fd)
    return n


def bind_process(cores: Sequence[int]) -> None:
    """Every thread of this process on ``cores``; threads started later inherit it from their starter."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:   # a thread that ended meanwhile
            pass


class CoreBinding:
    """A worker's seat, and its process on the cores that seat gets now (``cores``; None: unbound)."""

    def __init__(self, per_worker: int, usable: Sequence[int], directory: Path = SEATS_DIR) -> None:
        self.per_worker, self.usable = per_worker, sorted(usable)
        self.seats = Seats(directory)
        self.cores: list[int] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()   # a refresh and close, one at a time: no seat taken after close
        try:
            self.refresh()
        except BaseException:
            self.seats.release()
            raise

    def refresh(self) -> list[int] | None:
        with self._lock:
            if self._stop.is_set():
                return self.cores
            self.seats.take()
            cores = seat_cores(self.seats.seat, self.seats.seated(), self.per_worker, self.usable)
            bind_process(cores if cores is not None else self.usable)   # each time: threads started meanwhile
            if cores != self.cores:
                log.info("seat %d: %s", self.seats.seat, f"bound to cores {cores}" if cores else "unbound")
            self.cores = cores
            return cores

    def start(self) -> CoreBinding:
        threading.Thread(target=self._run, name="strata-cores", daemon=True).start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                self.refresh()
            except OSError as e:   # keep what it has; look again next time
                log.warning("refreshing the core binding failed: %s", e)

    def close(self) -> None:
        with self._lock:
            self._stop.set()
            self.seats.release()


def bind_worker(mode: str, device: str, torch_threads: int, ep_size: int) -> CoreBinding | None:
    """Seat and bind per ``cores_to_bind``, refreshed every REFRESH_S; None when it binds nothing. A seat that
    cannot be had (no writable temporary directory, no affinity call on this platform) leaves the process
    unbound, with a warning: binding is an optimisation, not a condition of serving."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    usable = sorted(os.sched_getaffinity(0))
    n = cores_to_bind(mode, device, torch_threads, ep_size, len(usable))
    if n == 0:
        return None
    try:
        return CoreBinding(n, usable).start()
    except OSError as e:
        log.warning("not binding this worker to cores: %s", e)
        return None
