"""strata's kernels/ under an import name it shares with Hugging Face's ``kernels`` distribution.

transformers >= 5.25 requires HF's ``kernels`` and imports it by that name (``from kernels import Mode``).
strata's kernels/ (the fixed layout) has no ``__init__.py``: it is a portion of a namespace package (PEP 420).
So:

- without HF's, ``kernels`` is a namespace package over strata's directory;
- with HF's installed in the site-packages where strata's wheel is, ``kernels`` is HF's regular package and
  strata's modules lie in its directory: no file of one distribution overwrites a file of the other;
- with HF's installed and strata's kernels/ elsewhere (a checkout: on PYTHONPATH, Ray's working_dir, the
  current directory), Python's import stops at HF's regular package, whose ``__path__`` is its own
  directory. Importing this module adds strata's directory to it (what ``pkgutil.extend_path`` does for a
  package that asks), so ``kernels.transfer`` resolves, while ``kernels`` itself stays the package
  transformers imports. (An editable install's finder would also find strata's modules; a checkout that
  is not installed has only this.)

strata's code imports its kernel modules through here, never ``kernels.*`` first:
``from storage.kernels_path import transfer``. The first import also runs HF's ``kernels/__init__.py``
when it is installed (~0.3 s: it loads huggingface_hub), so only the modules that copy pages import this.
"""
from __future__ import annotations

import importlib
import os

STRATA_KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")


def extend_path() -> list[str]:
    """Put strata's kernels/ on the ``kernels`` package's search path if it is not there; the path after."""
    package = importlib.import_module("kernels")
    path = package.__path__
    here = os.path.realpath(STRATA_KERNELS)
    if not any(os.path.realpath(p) == here for p in path):
        path.append(STRATA_KERNELS)
    return list(path)


extend_path()

from kernels import transfer  # noqa: E402  (after the path: HF's package may own the name)

__all__ = ["STRATA_KERNELS", "extend_path", "transfer"]
