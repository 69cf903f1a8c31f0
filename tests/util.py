"""Small helpers the test tiers share."""
import os
import signal
import time

from storage.ports import free_port  # noqa: F401 - the tests' one way to pick a port


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process this user can see (Linux /proc)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue        # gone meanwhile, or not ours to read
        out[int(d)] = (ppid, cmd)
    return out


def processes_started_under(*markers: str) -> set[int]:
    """The processes whose command line names one of ``markers`` (e.g. a Ray cluster's own --temp-dir and
    GCS address: its GCS, raylet, dashboard, agents and client server) and all their descendants (Ray's
    workers, a job's entrypoint)."""
    procs = _processes()
    own = {pid for pid, (_, cmd) in procs.items() if any(m in cmd for m in markers) and pid != os.getpid()}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    todo = list(own)
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in own and c != os.getpid():
                own.add(c)
                todo.append(c)
    return own


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"     # a zombie is gone but for its reaping
    except (OSError, IndexError):
        return False


def stop_processes_started_under(*markers: str, grace_s: float = 15.0) -> int:
    """Stops what ``processes_started_under(*markers)`` finds, and nothing else on the machine (unlike
    ``ray stop``, which ends every Ray cluster here, a user's running server included): SIGTERM, then
    SIGKILL for whatever is left after ``grace_s``. Returns how many processes it found."""
    pids = processes_started_under(*markers)
    found = len(pids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        pids = {p for p in pids | processes_started_under(*markers) if _alive(p)}
        if not pids:
            break
    return found


def wait_restarted(handle, timeout: float = 120.0) -> None:
    """Wait until the restarted actor ``handle`` (a WorkerActor, ``max_restarts=-1``) answers ``start``
    again: a new process, a new token channel. Ray raises RayActorError until it is back."""
    import ray
    deadline = time.monotonic() + timeout
    while True:
        try:
            ray.get(handle.start.remote(), timeout=60)
            return
        except ray.exceptions.RayActorError:
            assert time.monotonic() < deadline, f"the actor was not back in {timeout:.0f} s"
            time.sleep(0.5)
