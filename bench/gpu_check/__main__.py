"""``python -m bench.gpu_check``: runs the parts asked for, writes gpu_check.json as it goes and prints a
table per part (see the package docstring)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

import bench.gpu_check as package
from bench.gpu_check import PARTS, bandwidth, copy_kernels, env, speed
from bench.gpu_check import families as families_
from bench.gpu_check.checks import Skip


def _table(rows: list[dict], cols: list[str]) -> str:
    from bench.common import table
    return table(rows, cols)


def report(results: dict) -> str:
    lines = []
    for name, r in results["parts"].items():
        lines.append(f"\n== {name}: {r['status']}" + (f" ({r['reason']})" if r.get("reason") else ""))
        if name == "env" and "info" in r:
            lines += [f"  {k}: {v}" for k, v in r["info"].items()]
        if r.get("checks"):
            plain = ("check", "ok", "error", "traceback", "mismatches", "loadback")
            lines.append(_table([{"check": c["check"], "ok": "ok" if c["ok"] else "FAIL",
                                  "error / details": (c.get("error") or json.dumps(
                                      {k: v for k, v in c.items() if k not in plain}, default=str))[:150]}
                                 for c in r["checks"]], ["check", "ok", "error / details"]))
        if r.get("rows"):
            cols = [c for c in ("what", "layout", "direction", "backend", "GB/s", "layer_by_layer_GB/s",
                                "vs_link", "vs_copy_per_chunk", "tokens/s", "ms", "bound_ms", "of_bound")
                    if any(c in x for x in r["rows"])]
            lines.append(_table(r["rows"], cols))
        if "device_copy_GB/s" in r:
            lines.append(f"  device copy bandwidth (read + write): {r['device_copy_GB/s']:,.0f} GB/s")
    return "\n".join(lines)


def run(parts, device: str, quick: bool, families=None, on_part=None) -> dict:
    """{"device", "quick", "parts": {name: {"status": pass | FAIL | skip, ...}}}; ``on_part(results)``
    after each part."""
    if device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        gpu_only = not torch.cuda.is_available()
    else:
        dev = torch.device(device)
        gpu_only = False
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here")
    fns = {"env": env.run, "kernels": copy_kernels.run, "bandwidth": bandwidth.run,
           "engine": lambda d, q: families_.run(d, q, families), "speed": speed.run}
    results = {"device": str(dev), "quick": quick, "parts": {}}
    for name in parts:
        t = time.perf_counter()
        try:
            if gpu_only and name != "env":
                raise Skip("no CUDA device (torch.cuda.is_available() is False); --device cpu runs it on the CPU")
            r = fns[name](dev, quick)
            failed = [c for c in r.get("checks", []) if not c["ok"]]
            r["status"] = "FAIL" if failed else "pass"
        except Skip as e:
            r = {"status": "skip", "reason": str(e)}
        except Exception as e:
            r = {"status": "FAIL", "reason": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]}
        r["seconds"] = round(time.perf_counter() - t, 2)
        results["parts"][name] = r
        print(f"[gpu-check] {name}: {r['status']} in {r['seconds']} s", flush=True)
        if on_part is not None:
            on_part(results)   # written as it goes: a run cut short keeps the parts it finished
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=package.__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=os.environ.get("GPU_CHECK_PARTS") or ",".join(PARTS))
    ap.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT") or str(Path(__file__).parents[1] / "results" / "gpu_check"))
    ap.add_argument("--device", default=os.environ.get("GPU_CHECK_DEVICE", "auto"), choices=("auto", "cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", default=os.environ.get("GPU_CHECK_QUICK") == "1",
                    help="small sizes and two families (what the CPU run in the tests uses)")
    ap.add_argument("--families", default=os.environ.get("GPU_CHECK_FAMILIES"),
                    help=f"comma-separated, of {','.join(families_.FAMILIES)}")
    a = ap.parse_args(argv)
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown parts {unknown}; choose from {','.join(PARTS)}")
    families = tuple(f.strip() for f in a.families.split(",")) if a.families else None
    if families and set(families) - set(families_.FAMILIES):
        ap.error(f"unknown families {sorted(set(families) - set(families_.FAMILIES))}; "
                 f"choose from {','.join(families_.FAMILIES)}")
    # fp32 comparisons mean fp32: TF32 would round the engine's matmuls to 10-bit mantissas.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.environ.setdefault("STRATA_HOME", tempfile.mkdtemp(prefix="strata-home-"))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from bench.common import machine

    def write(results: dict) -> None:
        (out / "gpu_check.json").write_text(json.dumps({"machine": machine(), **results}, indent=2, default=str))
    results = run(parts, a.device, a.quick, families, on_part=write)
    print(report(results))
    print(f"\nwrote {out / 'gpu_check.json'}")
    return 1 if any(r["status"] == "FAIL" for r in results["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
