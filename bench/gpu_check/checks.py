"""What every part of the GPU check shares: named pass/fail results that never stop a part, the reason
a part skips, and timing that drains the device."""
from __future__ import annotations

import contextlib
import importlib
import statistics
import time
import traceback

import torch


class Skip(Exception):
    """A part that cannot run here (no GPU, say); its message is the reason."""


class Checks:
    """Named pass/fail results of one part; a failure keeps its error and the part goes on."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    @contextlib.contextmanager
    def check(self, name: str, **info):
        row = {"check": name, "ok": False, **info}
        self.rows.append(row)
        try:
            yield row
            row["ok"] = True
        except Exception as e:  # recorded, not raised: the other checks still run
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            row["traceback"] = traceback.format_exc()[-4000:]

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.rows if not r["ok"]]


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, reps: int, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs (after ``warmup``), the device drained around each."""
    for _ in range(warmup):
        fn()
    sync(dev)
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(dev)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def version(mod: str) -> str | None:
    try:
        from importlib.metadata import version as v
        return v(mod)
    except Exception:
        return None


def imports(mod: str) -> str:
    try:
        importlib.import_module(mod)
        return "yes"
    except Exception as e:
        return f"no ({type(e).__name__}: {str(e)[:80]})"
