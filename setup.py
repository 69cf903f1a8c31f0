"""The compiled modules: storage/_tokens.c (the radix tree's in-place token comparison; see
storage/tokens.py), storage/_hashing.c (the page-key chain as block ids, for the router's prompts; see
storage/hashing.py), storage/l3/_fileio.c (the file L3 store's system calls for a batch; see
storage/l3/file.py) and actors/_routing.c (the prefix index's walk; see actors/routing.py). Everything
else about the package is in pyproject.toml. ``optional``: where one cannot build (no C compiler), the
install goes on and the Python module falls back to Python."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("storage._tokens", ["storage/_tokens.c"], optional=True),
                   Extension("storage._hashing", ["storage/_hashing.c"], optional=True),
                   Extension("storage.l3._fileio", ["storage/l3/_fileio.c"], optional=True),
                   Extension("actors._routing", ["actors/_routing.c"], optional=True)])
