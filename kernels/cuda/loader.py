"""Build ``hicache.cu`` with nvcc into a small shared library and call it through ctypes.

No torch C++ extension machinery: the library has a plain C ABI (see the .cu header), so a CPU-only or
any CUDA build of torch can load it. Built libraries are cached under ``$STRATA_HOME/kernels`` (default
``~/.cache/strata/kernels``), keyed by a hash of the source, the nvcc binary and the flags, so editing the
source or changing the target GPU rebuilds and nothing else does.

Environment: ``STRATA_NVCC`` (nvcc binary; else ``nvcc`` on PATH or /usr/local/cuda/bin/nvcc),
``STRATA_CUDA_ARCH`` (e.g. ``90``; else the current GPU's capability, else 80).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from kernels.ref import L1_TO_L2, L2_TO_L1, CopyPlan, plan

SOURCE = Path(__file__).with_name("hicache.cu")
ABI_VERSION = 1
_BASE_FLAGS = ["-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static"]


def nvcc_path() -> str | None:
    for cand in (os.environ.get("STRATA_NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def cache_dir() -> Path:
    home = os.environ.get("STRATA_HOME")
    root = Path(home) if home else Path.home() / ".cache" / "strata"
    return root / "kernels"


def default_arch() -> str:
    """Compute capability to build for, as digits (e.g. "90")."""
    env = os.environ.get("STRATA_CUDA_ARCH")
    if env:
        return env.replace("sm_", "").replace(".", "")
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}{minor}"
    return "80"  # L1::no_allocate needs sm_70+, and CUDA 13 builds sm_75+ only


def arch_flags(arch: str) -> list[str]:
    # SASS for the target plus its PTX, so a newer GPU can still JIT the library.
    return ["-gencode", f"arch=compute_{arch},code=[sm_{arch},compute_{arch}]"]


def _run_nvcc(args: list[str]) -> None:
    nvcc = nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (set STRATA_NVCC or put nvcc on PATH)")
    proc = subprocess.run([nvcc, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed ({proc.returncode}):\n{proc.stderr.strip()}")


def build(arch: str | None = None, force: bool = False) -> Path:
    """Compile the library (unless an identical build is cached) and return its path.
    Raises FileNotFoundError without nvcc, RuntimeError when nvcc fails."""
    arch = arch or default_arch()
    flags = [*_BASE_FLAGS, *arch_flags(arch)]
    key = hashlib.sha256(SOURCE.read_bytes() + repr((nvcc_path(), flags)).encode()).hexdigest()[:16]
    out = cache_dir() / f"hicache-sm{arch}-{key}.so"
    if out.exists() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent builders never see a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        _run_nvcc([*flags, "-o", tmp, str(SOURCE)])
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def ptx(arch: str | None = None) -> str:
    """The PTX nvcc generates for the source (used by tests to check the cache hints)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "hicache.ptx"
        _run_nvcc(["-ptx", "-std=c++17", f"-arch=compute_{arch or default_arch()}", "-o", str(path), str(SOURCE)])
        return path.read_text()


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.strata_hicache_abi_version.restype = ctypes.c_int
    if lib.strata_hicache_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path}: ABI version {lib.strata_hicache_abi_version()} != {ABI_VERSION}")
    lib.strata_copy_pages.restype = ctypes.c_int
    lib.strata_copy_pages.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 11 + [ctypes.c_void_p]
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library when a GPU is present and the build succeeds, else None (warned once)."""
    if not torch.cuda.is_available():
        return None
    try:
        return load(build())
    except (OSError, RuntimeError) as exc:  # FileNotFoundError is an OSError
        warnings.warn(f"strata CUDA copy kernels unavailable, falling back: {exc}", RuntimeWarning)
        return None


def available() -> bool:
    return library() is not None


def copy_pages(p: CopyPlan, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
    """Launch one planned copy on the current stream of the L1 device (asynchronous).
    src_pages/dst_pages: [n] int64 tensors on that GPU."""
    lib = library()
    if lib is None:
        raise RuntimeError("CUDA copy library is not available")
    n = src_pages.numel()
    if n == 0 or p.n_layers == 0:
        return
    dev = src_pages.device
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
    es = p.src.element_size()
    b = [s * es for s in (*p.src_strides, *p.dst_strides)]
    err = lib.strata_copy_pages(
        p.src.data_ptr(), p.dst.data_ptr(), src_pages.data_ptr(), dst_pages.data_ptr(),
        n, p.layer0, p.n_layers, *b, p.n_chunks, p.chunk * es, stream)
    if err != 0:
        raise RuntimeError(f"strata_copy_pages failed with cudaError {err}")


def cuda_l1_to_l2(l1: torch.Tensor, l2: torch.Tensor, layout: str, src_pages: torch.Tensor,
                  dst_pages: torch.Tensor, layer: int | None = None) -> None:
    """Backup: l2 page dst_pages[i] <- l1 page src_pages[i]. l1: [L, P1, E] on a GPU; l2 pinned or on it."""
    dev = l1.device
    copy_pages(plan(l1, l2, layout, L1_TO_L2, layer), src_pages.to(dev, torch.int64), dst_pages.to(dev, torch.int64))


def cuda_l2_to_l1(l1: torch.Tensor, l2: torch.Tensor, layout: str, src_pages: torch.Tensor,
                  dst_pages: torch.Tensor, layer: int | None = None) -> None:
    """Load: l1 page dst_pages[i] <- l2 page src_pages[i]. Same shapes as cuda_l1_to_l2."""
    dev = l1.device
    copy_pages(plan(l1, l2, layout, L2_TO_L1, layer), src_pages.to(dev, torch.int64), dst_pages.to(dev, torch.int64))
