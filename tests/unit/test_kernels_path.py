"""strata's kernels/ and Hugging Face's ``kernels`` (a dependency of transformers >= 5.25) share one import
name (storage/kernels_path.py). Each child process below starts outside the checkout with the checkout on
PYTHONPATH and without the editable install's finder (a checkout that is not installed: Ray's working_dir,
the GPU machine's run), so that nothing resolves through the current directory or the install, and imports
HF's package (through transformers) and strata's copies in either order: both must work, and a page round
trip through strata's dispatch must give back the bits it moved."""
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _hf_kernels_files() -> set[str] | None:
    try:
        files = importlib.metadata.files("kernels")
    except importlib.metadata.PackageNotFoundError:
        return None
    return {f.as_posix() for f in files or () if f.as_posix().startswith("kernels/")}


HF_FILES = _hf_kernels_files()
needs_hf = pytest.mark.skipif(HF_FILES is None, reason="Hugging Face's kernels is not installed (transformers < 5.25)")

ROUND_TRIP = """
import os
import torch
from storage.kernels_path import transfer, STRATA_KERNELS
assert os.path.realpath(transfer.__file__).startswith(os.path.realpath(STRATA_KERNELS)), transfer.__file__
g = torch.Generator().manual_seed(0)
for layout in transfer.LAYOUTS:
    l1 = torch.randint(-2**15, 2**15, (3, 9, 2 * 4 * 2 * 8), generator=g, dtype=torch.int16)
    l2 = transfer.alloc_l2(layout, 3, 7, 4, l1.shape[2], torch.int16)
    assert transfer.l1_to_l2(l1, l2, layout, [4, 0, 8], [6, 1, 2]) == "torch"
    back = torch.zeros_like(l1)
    transfer.l2_to_l1(back, l2, layout, [6, 1, 2], [4, 0, 8])
    assert torch.equal(back[:, [4, 0, 8]], l1[:, [4, 0, 8]]), layout
    assert not back[:, [1, 2, 3, 5, 6, 7]].any(), layout
"""

HF_SIDE = """
import importlib.metadata
import kernels
from transformers.utils import is_kernels_available
assert is_kernels_available()
import transformers.integrations.hub_kernels as hub   # its `from kernels import CUDAProperties, Mode, ...`
from kernels import CUDAProperties, LayerRepository, Mode, kernelize
assert kernels.__version__ == importlib.metadata.version("kernels"), kernels.__version__
assert hub.LayerRepository is LayerRepository
"""


NOT_INSTALLED = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path_hooks[:] = [h for h in sys.path_hooks if not getattr(h, "__module__", "").startswith("__editable__")]
sys.path_importer_cache.clear()
"""


def _child(code: str, tmp_path: Path, extra_path: str | None = None) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (extra_path, str(ROOT)) if p)}
    out = subprocess.run([sys.executable, "-c", NOT_INSTALLED + code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


@needs_hf
@pytest.mark.parametrize("first", ["strata", "transformers"])
def test_both_packages_import_in_either_order(tmp_path, first):
    """The checkout's case: HF's regular package in site-packages, strata's kernels/ in the checkout."""
    _child((ROUND_TRIP + HF_SIDE) if first == "strata" else (HF_SIDE + ROUND_TRIP), tmp_path)


def test_without_hugging_face_kernels_it_is_a_namespace_of_strata_alone(tmp_path):
    """As where HF's package is not installed: ``kernels`` is found on sys.path as Python finds it, with
    every directory that holds a regular ``kernels`` package left out."""
    hide = """
import importlib.machinery, os, sys
class NoHF:
    def find_spec(self, name, path=None, target=None):
        if name != "kernels":
            return None
        dirs = [p for p in sys.path if not os.path.isfile(os.path.join(p or ".", "kernels", "__init__.py"))]
        return importlib.machinery.PathFinder.find_spec(name, dirs)
sys.meta_path.insert(0, NoHF())
"""
    _child(hide + ROUND_TRIP + """
import kernels
assert kernels.__file__ is None and not hasattr(kernels, "CUDAProperties"), kernels
""", tmp_path)


@needs_hf
def test_installed_into_one_directory_no_file_clashes(tmp_path):
    """As pip installs both wheels into one site-packages: strata's kernels/ files and HF's never share a
    path (strata ships no ``kernels/__init__.py``), and with both in one ``kernels/`` directory each side
    imports. strata's files are copied where HF's installed package lies, as its wheel would put them."""
    ours = {p.relative_to(ROOT).as_posix() for p in (ROOT / "kernels").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}
    assert "kernels/__init__.py" not in ours
    assert {"kernels/transfer.py", "kernels/ref.py", "kernels/cuda/loader.py"} <= ours
    assert not ours & HF_FILES, sorted(ours & HF_FILES)
    site = tmp_path / "site"
    hf_dir = Path(importlib.metadata.distribution("kernels").locate_file("kernels"))
    for rel in HF_FILES:
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).symlink_to(hf_dir.parent / rel)
    for rel in ours:
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).symlink_to(ROOT / rel)
    out = _child(HF_SIDE + ROUND_TRIP + """
import kernels
print(kernels.__path__)
""", tmp_path / "site", extra_path=str(site))
    assert str(site / "kernels") in out, out
