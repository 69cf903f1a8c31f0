"""Shared bits of the bench scripts: a results folder and a plain-text table."""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return path


def merge_json(name: str, key: str, value: dict) -> Path:
    """``value`` under ``key`` in results/<name>.json, every other key of it kept (runs of one bench under
    their own labels, in one file)."""
    path = RESULTS / f"{name}.json"
    prior = {k: v for k, v in json.loads(path.read_text()).items() if k != "machine"} if path.exists() else {}
    prior[key] = value
    return write_json(name, prior)


def table(rows: list[dict], cols: list[str]) -> str:
    w = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    line = "  ".join(c.ljust(w[c]) for c in cols)
    out = [line, "  ".join("-" * w[c] for c in cols)]
    out += ["  ".join(_fmt(r.get(c)).ljust(w[c]) for c in cols) for r in rows]
    return "\n".join(out)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return "" if v is None else str(v)
