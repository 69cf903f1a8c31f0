"""The env part: the device, the software stack (torch, Triton, transformers, nvcc) and what imports."""
from __future__ import annotations

import platform
import subprocess

import torch

from bench.gpu_check.checks import imports, version

OPTIONAL = ("ray", "llguidance", "mooncake", "nixl", "triton", "transformers")


def run(dev: torch.device, quick: bool) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "device": str(dev),
            "cuda_available": torch.cuda.is_available(), "triton": version("triton"),
            "transformers": version("transformers"), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "imports": {m: imports(m) for m in OPTIONAL}}
    import storage.kernels_path  # noqa: F401  (kernels/ on the `kernels` package's path)
    from kernels.cuda import loader
    nvcc = loader.nvcc_path()
    info["nvcc"] = nvcc
    if nvcc:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
        info["nvcc_version"] = out[-1] if out else None
    from storage import tokens
    info["compiled_token_helper"] = bool(getattr(tokens, "COMPILED", False))
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1), torch_cuda=torch.version.cuda,
                    matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32)
    return {"info": info}
