"""The HTTP ingress and the router never load torch: each of their processes (every ingress replica, and
each restart of one after a fault) would pay ~2 s of start and ~180 MiB for it. What they load is their
own modules, the worker's actor module (Ray loads an actor's class in every process that receives a handle
to it) and the cluster's settings they are given (unpickled, configs of every section)."""
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p.name for p in (ROOT / "cluster/configs").glob("*.yaml"))

# A child process where importing torch (or transformers) fails, so that the module that tries is named.
CHILD = """
import pickle, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} imported")
sys.meta_path.insert(0, Refuse())
import actors.ingress, actors.router, actors.worker
every = pickle.loads(sys.stdin.buffer.read())
assert len(every) > 10 and all(s.engine.page_size > 0 for s in every)
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")))
"""


def test_the_ingress_and_the_router_load_no_torch():
    settings = pickle.dumps([load_config(ROOT / "cluster/configs" / name) for name in CONFIGS])
    out = subprocess.run([sys.executable, "-c", CHILD], input=settings, capture_output=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    assert out.stdout.decode().strip() == "[]", out.stdout.decode()[-2000:]


def test_the_engine_package_gives_its_names_on_first_use():
    """The engine's names load on first use (engine/__init__.py), the same objects as their modules'."""
    import engine
    from engine.engine import Engine
    from engine.config import EngineConfig, EplbConfig
    from engine.eplb import EplbConfig as FromEplb
    assert engine.Engine is Engine and engine.EngineConfig is EngineConfig and FromEplb is EplbConfig
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        engine.Engin   # noqa: B018
