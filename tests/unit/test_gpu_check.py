"""The GPU check (bench/gpu_check.py) as the GPU image will run it: a plain python with none of Ray,
llguidance, Mooncake or NIXL, and without the compiled token helper (built for another Python there).
Its parts run on the CPU at small sizes (``--device cpu --quick``), so the check cannot rot before a GPU
machine is at hand; on a machine without a GPU its default run skips the GPU parts, naming why."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What the GPU image lacks: importing any of these fails there as it does here in the subprocess.
BLOCKED = ("ray", "llguidance", "mooncake", "nixl", "nixl_cu12", "storage._tokens")

BOOT = """
import importlib.abc, runpy, sys
BLOCKED = set(sys.argv[1].split(","))
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in BLOCKED or name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: the GPU image lacks it)")
sys.meta_path.insert(0, Block())
sys.argv = ["bench.gpu_check", *sys.argv[2:]]
runpy.run_module("bench.gpu_check", run_name="__main__", alter_sys=True)
"""


def _run(tmp_path, *args) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    proc = subprocess.run([sys.executable, "-c", BOOT, ",".join(BLOCKED), "--out", str(out), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    path = out / "gpu_check.json"
    return proc, (json.loads(path.read_text()) if path.is_file() else None)


def test_every_part_runs_on_the_cpu_without_ray_llguidance_mooncake_nixl(tmp_path):
    proc, res = _run(tmp_path, "--device", "cpu", "--quick")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    parts = res["parts"]
    assert list(parts) == ["env", "kernels", "bandwidth", "engine", "speed"]
    assert {n: p["status"] for n, p in parts.items()} == dict.fromkeys(parts, "pass"), \
        {n: p.get("reason") or [c for c in p.get("checks", []) if not c["ok"]] for n, p in parts.items()}
    info = parts["env"]["info"]
    assert all(info["imports"][m].startswith("no") for m in ("ray", "llguidance", "mooncake", "nixl"))
    assert info["compiled_token_helper"] is False          # the Python fallback served the radix tree
    # Each part did its work: every backend case, both tiers of every family, every figure.
    kernel_rows = parts["kernels"]["checks"]
    assert kernel_rows and all(r["cases"] > 0 for r in kernel_rows if "cases" in r)
    engine = {c["check"]: c for c in parts["engine"]["checks"]}
    assert engine["strata-tiny: cpu prefix from L1, then from L2 (layer-wise load-back)"]["cached"]["L2"] > 0
    assert engine["gemma3: cpu tokens and logits = transformers"]["compared"] > 0
    assert {r["what"].split(",")[0] for r in parts["speed"]["rows"]} >= {"prefill 96 tokens", "decode"}
    assert any("L2 hit" in r["what"] for r in parts["speed"]["rows"])
    assert len([r for r in parts["bandwidth"]["rows"] if r["backend"] == "torch"]) >= 6
    assert "== engine: pass" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the default run uses it")
def test_without_a_gpu_the_default_run_skips_the_gpu_parts_naming_why(tmp_path):
    proc, res = _run(tmp_path, "--parts", "env,kernels,engine")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    parts = res["parts"]
    assert parts["env"]["status"] == "pass" and parts["env"]["info"]["cuda_available"] is False
    for name in ("kernels", "engine"):
        assert parts[name]["status"] == "skip" and "no CUDA device" in parts[name]["reason"]


def test_an_unknown_part_is_refused_by_name(tmp_path):
    proc, res = _run(tmp_path, "--parts", "kernels,warp")
    assert proc.returncode == 2 and res is None
    assert "unknown parts ['warp']" in proc.stderr
