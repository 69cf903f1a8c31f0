"""Dynamo's runtime lives in a directory of its own (the Makefile installs it with ``pip install --no-deps
--target .venv/interop``: its pin would cap pydantic for the whole venv). Appended, so it shadows nothing."""
import sys
from pathlib import Path

_DIR = Path(__file__).resolve().parents[2] / ".venv" / "interop"
if _DIR.is_dir() and str(_DIR) not in sys.path:
    sys.path.append(str(_DIR))
