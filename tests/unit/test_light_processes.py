"""The HTTP ingress and the router never load torch: each of their processes (every ingress replica, and
each restart of one after a fault) would pay ~2 s of start and ~180 MiB for it. What they load is their
own modules, the worker's actor module (Ray loads an actor's class in every process that receives a handle
to it: the EPLB rebalancer's too, whose status an ingress reads for /metrics) and the cluster's settings
they are given (unpickled, configs of every section). Nor does `strata rebalance`.

Nor does the launcher (``strata serve``, a RayJob's driver), which reads the checkpoint's layer spec for
the router and the L3 namespace: every family's config.json parser is plain Python
(engine/model/hf_config.py), and a family's model module is imported only to build the model."""
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.config import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p.name for p in (ROOT / "cluster/configs").glob("*.yaml"))

# A child process where importing torch (or transformers, or `kernels`: strata's copies need torch, and
# Hugging Face's package under that name loads huggingface_hub, ~0.3 s) fails, so that the module that tries
# is named.
REFUSE = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "kernels"):
            raise ImportError(f"{name} imported")
sys.meta_path.insert(0, Refuse())
"""
CHILD = REFUSE + """
import pickle
import actors.ingress, actors.router, actors.worker, actors.eplb_actor, cluster.cli
every = pickle.loads(sys.stdin.buffer.read())
assert len(every) > 10 and all(s.engine.page_size > 0 for s in every)
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "kernels")))
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


# One small config.json per family, as its publisher's layout has it, and the layer spec each must give
# (the window: None where no layer slides, and no pool is sized by it).
FAMILIES = {
    "GptOssForCausalLM": ({"intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
                           "sliding_window": 8}, ("sliding_attention", "full_attention"), 8),
    "LlamaForCausalLM": ({"intermediate_size": 32}, ("full_attention", "full_attention"), None),
    "Qwen3ForCausalLM": ({"intermediate_size": 32, "use_sliding_window": True, "sliding_window": 8,
                          "max_window_layers": 1}, ("full_attention", "sliding_attention"), 8),
    "Qwen3MoeForCausalLM": ({"intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                             "moe_intermediate_size": 16}, ("full_attention", "full_attention"), None),
    "Gemma3ForCausalLM": ({"intermediate_size": 32, "sliding_window": 8, "sliding_window_pattern": 2},
                          ("sliding_attention", "full_attention"), 8),
}
LAUNCHER_CHILD = REFUSE + """
import json
from pathlib import Path
import cluster.launch   # strata serve's and a RayJob's driver
from engine.config import EngineConfig, model_id
from engine.model.checkpoint import resolve_model_path
from engine.model.config import ModelConfig
from storage.geometry import KVGeometry
out = {}
for path in [resolve_model_path("strata-tiny")] + [Path(p) for p in json.loads(sys.stdin.read())]:
    mc = ModelConfig.from_dir(path)   # what start_actors reads, for the router's geometry and the L3 namespace
    KVGeometry.from_layers(mc.layer_types, mc.sliding_window, 16)
    out[path.name] = [mc.architecture, list(mc.layer_types), mc.sliding_window, model_id(path, mc, EngineConfig())]
print(json.dumps(out))
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "kernels")))
"""


def test_the_launcher_reads_every_familys_layer_spec_without_torch(tmp_path, monkeypatch):
    from engine.model.checkpoint import resolve_model_path
    from engine.model.config import ModelConfig
    from engine.model.registry import ARCHITECTURES, build_model
    assert set(FAMILIES) == set(ARCHITECTURES)
    monkeypatch.setenv("STRATA_HOME", str(tmp_path / "home"))
    resolve_model_path("strata-tiny")   # made here (that takes torch), read in the child
    dirs = []
    for arch, (extra, _, _) in FAMILIES.items():
        d = {"architectures": [arch], "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, **extra}
        (tmp_path / arch).mkdir()
        (tmp_path / arch / "config.json").write_text(json.dumps(d))
        dirs.append(str(tmp_path / arch))
        # The registry's model class for it, built from the parsed config (the worker's path).
        assert type(build_model(ModelConfig.from_dir(tmp_path / arch))).__name__ == arch
    out = subprocess.run([sys.executable, "-c", LAUNCHER_CHILD], input=json.dumps(dirs).encode(),
                         capture_output=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    specs, loaded = out.stdout.decode().strip().splitlines()[-2:]
    assert loaded == "[]", loaded
    specs = json.loads(specs)
    assert specs.pop("strata-tiny-s0")[:3] == ["GptOssForCausalLM", ["sliding_attention", "full_attention"] * 2, 64]
    for arch, (_, layers, window) in FAMILIES.items():
        got_arch, got_layers, got_window, l3_model = specs[arch]
        assert (got_arch, tuple(got_layers)) == (arch, layers)
        assert window is None or got_window == window
        assert l3_model.startswith(f"{arch}/L2h32kv1d16/")
