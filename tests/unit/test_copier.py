"""storage/copier.py: where a job runs. On a CPU the pools are all host memory, so memory jobs (L1 <-> L2
copies) run in ``submit`` on the caller's thread; I/O jobs (L3 writes) run on the copier's thread. Either
way ``on_done`` waits for a ``poll`` and completions come back in submission order."""
from __future__ import annotations

import threading

import torch

from storage.copier import Copier, Job, LayerFuture


def _job(log: list, name: str, memory: bool, gate: threading.Event | None = None) -> Job:
    def run(fut: LayerFuture) -> None:
        if gate is not None:
            assert gate.wait(10)
        log.append((name, threading.current_thread().name))
    return Job(run, LayerFuture({}), lambda: log.append((name, "done")), tag=name, memory=memory)


def test_on_a_cpu_memory_jobs_run_in_submit_and_io_jobs_on_the_thread():
    c = Copier(device=torch.device("cpu"))
    log: list = []
    gate = threading.Event()
    io = c.submit(_job(log, "l3 write", memory=False, gate=gate))
    mem = c.submit(_job(log, "backup", memory=True))
    assert mem.done and log == [("backup", threading.current_thread().name)]   # ran here, before the I/O
    assert c.poll() == 0 and c.num_pending == 2     # its on_done waits behind the unfinished I/O job
    gate.set()
    assert io.wait(10)
    assert c.poll(block=True) == 2
    assert log[1:] == [("l3 write", "strata-copier"), ("l3 write", "done"), ("backup", "done")]
    c.close()


def test_a_failed_memory_job_is_reported_on_its_future():
    c = Copier(device="cpu")

    def boom(fut: LayerFuture) -> None:
        raise RuntimeError("copy failed")
    fut = c.submit(Job(boom, LayerFuture({"full": 1}), lambda: None, memory=True))
    assert fut.done and isinstance(fut.error, RuntimeError)
    c.poll(block=True)
    c.close()


def test_without_a_device_every_job_runs_on_the_thread():
    c = Copier("strata-l3-prefetch")      # the prefetcher's: its reads are I/O whatever the job says
    log: list = []
    c.submit(_job(log, "read", memory=True)).wait(10)
    assert log == [("read", "strata-l3-prefetch")]
    c.close()
