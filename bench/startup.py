"""Start-up time of ``strata serve``: seconds from the command to the port's first answer, to the first
200 of /generate and to /health 200, and where they go (the phases launch reports on its
``strata: start-up`` line). Also counts the error-looking lines a fresh start logs (Ray's own log files
included), which should be none.

    python -m bench.startup [--runs 2] [--config cluster/configs/default.yaml]

Each run starts a fresh local Ray cluster in its own STRATA_HOME and stops it (SIGINT) when measured.
Writes bench/results/startup.json.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

from bench.common import table, write_json
from storage.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
# Lines that read as errors to an operator: Ray's glog "E"/"F" prefix, Python's ERROR/CRITICAL records,
# tracebacks, and Serve re-using a controller whose options it then ignores.
ALARMING = re.compile(r"(^\[?[EF]\d{4} |^[EF]\d{4}|\bERROR\b|\bCRITICAL\b|Traceback \(most recent call last\)|"
                      r"Connecting to existing Serve app|constructor arguments in the object store)")
PHASE = re.compile(r"strata: start-up ([\d.]+)s: (.*)")


def alarming(lines: list[str]) -> list[str]:
    """The error-looking lines among ``lines`` (stripped)."""
    return [ln.strip() for ln in lines if ALARMING.search(ln)]


def ray_log_lines(home: str) -> list[str]:
    """Lines of the Ray session's own log files under ``home`` (the driver is quiet: log_to_driver=False)."""
    out = []
    for path in glob.glob(os.path.join(home, "**", "session_*", "logs", "*"), recursive=True):
        if os.path.isfile(path) and path.endswith((".log", ".err", ".out")):
            try:
                out += Path(path).read_text(errors="replace").splitlines()
            except OSError:
                pass
    return out


def one_run(config: str, timeout: float) -> dict:
    home = tempfile.mkdtemp(prefix="strata-startup-")
    cfg = yaml.safe_load(Path(config).read_text())
    port = free_port()
    cfg.setdefault("server", {})["port"] = port
    cfg_path = os.path.join(home, "cluster.yaml")
    Path(cfg_path).write_text(yaml.safe_dump(cfg))
    # Ray's session files under this run's own folder, so their logs can be read and nothing is shared.
    env = {**os.environ, "STRATA_HOME": home, "RAY_TMPDIR": os.path.join(home, "ray"), "PYTHONUNBUFFERED": "1"}
    os.makedirs(env["RAY_TMPDIR"], exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--config", cfg_path], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    marks: dict[str, float] = {}
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    try:
        with httpx.Client(timeout=5) as c:
            while len(marks) < 3 and time.monotonic() - t0 < timeout and proc.poll() is None:
                try:
                    h = c.get(f"{url}/health")
                    marks.setdefault("first_answer_s", time.monotonic() - t0)
                    if h.status_code == 200:
                        marks.setdefault("health_200_s", time.monotonic() - t0)
                    if "generate_200_s" not in marks and c.post(f"{url}/generate", json=body).status_code == 200:
                        marks["generate_200_s"] = time.monotonic() - t0
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        time.sleep(1.0)    # let the launcher print its start-up line
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(5)
    phases = {}
    for ln in lines:
        m = PHASE.search(ln)
        if m:
            phases = {k: float(v.rstrip("s")) for k, v in (p.split(" ") for p in m.group(2).split(", "))}
    # Only the start: what a stop logs (SIGINT ends Ray's workers) is not the start-up's.
    start_lines = lines[:next((i for i, ln in enumerate(lines) if "draining" in ln or "stopped" in ln), len(lines))]
    bad = alarming(start_lines) + [f"[ray log] {ln}" for ln in alarming(ray_log_lines(home))
                                   if "core_worker" in ln or "Serve" in ln or "strata" in ln]
    return {**{k: round(v, 2) for k, v in marks.items()}, "phases": phases, "alarming_lines": bad,
            "output": [ln.rstrip() for ln in start_lines][-40:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.startup")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--config", default=str(ROOT / "cluster" / "configs" / "default.yaml"))
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--label", default="now", help="a name for this measurement in the JSON (before/after)")
    args = ap.parse_args(argv)
    runs = [one_run(args.config, args.timeout) for _ in range(args.runs)]
    cols = ["run", "first_answer_s", "generate_200_s", "health_200_s"]
    phase_names = sorted({k for r in runs for k in r["phases"]})
    print(table([{"run": i, **r, **{f"{k}_s": v for k, v in r["phases"].items()}} for i, r in enumerate(runs)],
                cols + [f"{k}_s" for k in phase_names]))
    for i, r in enumerate(runs):
        print(f"run {i}: {len(r['alarming_lines'])} error-looking lines" +
              "".join(f"\n  {ln[:200]}" for ln in r["alarming_lines"]))
    path = ROOT / "bench" / "results" / "startup.json"
    prior = {}
    if path.exists():
        import json
        prior = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("machine",)}
    prior[args.label] = {"config": os.path.relpath(args.config, ROOT), "cpus": os.cpu_count(), "runs": runs}
    write_json("startup", prior)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
