"""The one compiled module, storage/_tokens.c (the radix tree's in-place token comparison; see
storage/tokens.py). Everything else about the package is in pyproject.toml. ``optional``: where it
cannot build (no C compiler), the install goes on and storage/tokens.py falls back to Python."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("storage._tokens", ["storage/_tokens.c"], optional=True)])
