"""Background copies between L1 and L2, off the forward's critical path.

One worker thread runs the jobs in order (torch releases the GIL inside copies, so on a CPU they overlap
the forward; on a GPU the kernels run on a side stream). A load signals each pool layer as soon as that
layer is in L1, so a forward can start its early layers while later ones are still arriving.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional


class LayerFuture:
    """Completion of one job, per (component, pool layer slot)."""

    def __init__(self, layers: dict[str, int]) -> None:
        self._events = {(c, s): threading.Event() for c, n in layers.items() for s in range(n)}
        self._all = threading.Event()
        self.error: Optional[BaseException] = None

    def set_layer(self, component: str, slot: int) -> None:
        self._events[(component, slot)].set()

    def set_done(self, error: Optional[BaseException] = None) -> None:
        self.error = error
        for e in self._events.values():
            e.set()
        self._all.set()

    def wait_layer(self, component: str, slot: int, timeout: float | None = None) -> None:
        ev = self._events.get((component, slot))
        if ev is not None and not ev.wait(timeout):
            raise TimeoutError(f"layer {component}/{slot} not loaded in {timeout}s")
        if self.error is not None:
            raise RuntimeError("KV copy failed") from self.error

    def wait(self, timeout: float | None = None) -> bool:
        return self._all.wait(timeout)

    @property
    def done(self) -> bool:
        return self._all.is_set()


@dataclass
class Job:
    """``run(future)`` does the copies and marks layers; ``on_done`` runs on the owner's thread."""

    run: Callable[[LayerFuture], None]
    future: LayerFuture
    on_done: Callable[[], None]
    tag: str = ""
    payload: dict = field(default_factory=dict)


class Copier:
    def __init__(self, name: str = "strata-copier") -> None:
        self._q: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._pending: list[Job] = []
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> LayerFuture:
        self._pending.append(job)
        self._q.put(job)
        return job.future

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                job.run(job.future)
                job.future.set_done()
            except BaseException as e:  # surfaced to whoever waits on the future
                job.future.set_done(e)

    def poll(self, block: bool = False) -> int:
        """Run the completion callbacks of finished jobs (all of them when ``block``), in order."""
        n = 0
        while self._pending and (block or self._pending[0].future.done):
            job = self._pending[0]
            job.future.wait()
            self._pending.pop(0)
            job.on_done()
            n += 1
        return n

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def pending(self) -> list[Job]:
        return list(self._pending)

    def close(self) -> None:
        self.poll(block=True)
        self._q.put(None)
        self._thread.join(timeout=5)
