"""P/D across nodes over the one-sided backends, and L3 in one Mooncake master shared by every node: the
3-node local cluster, one worker per node, each worker's transfer engine and Mooncake client advertising
its own node's address (``host: auto``, ``local_hostname: auto``). Tokens equal Engine.generate; a
conversation moved to the other prefill node reads its prefix from the master's store. (Slow: a
deployment per backend; the CI variant is test_cross_node.py over ray_object and the file L3.)"""
import dataclasses
import time

import pytest
import ray

from cluster import launch
from engine import Engine, SamplingParams
from storage.l3.config import L3Config, MooncakeConfig
from tests import numerics
from tests.multinode.conftest import mn_config
from tests.multinode.test_cross_node import _gen
from tests.util import free_port

pytestmark = pytest.mark.slow


def _mooncake_l3() -> L3Config:
    return L3Config(backend="mooncake", capacity_bytes=256 << 20, prefetch_policy="timeout", prefetch_timeout_base=5.0,
                    mooncake=MooncakeConfig(master_addr=f"127.0.0.1:{free_port()}", local_hostname="auto",
                                            segment_bytes=16 << 20, op_timeout_s=2.0, setup_timeout_s=20.0))


def _can_run(backend: str) -> str | None:
    try:
        if backend == "nixl":
            from storage.l3.nixl import _load_nixl
            _load_nixl()
        else:
            from mooncake.engine import TransferEngine  # noqa: F401
            from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.numerics
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_pd_across_nodes_over_each_one_sided_backend(local_cluster, tmp_path_factory, backend):
    err = _can_run(backend)
    if err:
        pytest.skip(f"{backend} cannot load here: {err}")
    cfg = mn_config(tmp_path_factory, strategy="spread")
    tcfg = dataclasses.replace(cfg.transfer, backend=backend, host="auto", staging_pages=4096)
    hc = cfg.engine.hicache
    if backend == "mooncake":      # and L3 in one master every node reaches
        hc = dataclasses.replace(hc, l3=_mooncake_l3())
    cfg = dataclasses.replace(cfg, transfer=tcfg, engine=dataclasses.replace(cfg.engine, hicache=hc))
    h = launch.deploy(cfg)
    try:
        where = ray.get([w.node.remote() for w in h["workers"].values()], timeout=60)
        assert len(set(where)) == 3
        ref = Engine.from_pretrained(h["model_path"], page_size=16, num_pages=512)
        mc = ref.model_config

        def want(ids):
            return ref.generate([ids], SamplingParams(max_new_tokens=8, return_logits=True))[0]
        for ids in ([5, 6, 7], list(range(90)), [i % 256 for i in range(3, 300)]):
            r = _gen(h["url"], ids)
            assert r["meta_info"]["route"]["decode"]
            numerics.assert_same_output(r["output_ids"], want(ids), mc, f"{backend} across nodes")
        ts = ray.get(h["workers"]["prefill-0"].transfer_stats.remote())
        assert ts.backend == backend
        if backend != "mooncake":
            return
        hist = [(i * 19) % 251 for i in range(520)]
        r1 = _gen(h["url"], hist)
        p1 = r1["meta_info"]["route"]["prefill"]
        time.sleep(1.5)
        ray.get(h["router"].remove_worker.remote(p1))
        turn2 = hist + r1["output_ids"] + [3] * 40
        r2 = _gen(h["url"], turn2)
        assert r2["meta_info"]["route"]["prefill"] != p1
        assert r2["meta_info"]["cached_tokens_by_tier"]["L3"] >= 16 * (len(hist) // 16) - 32
        numerics.assert_same_output(r2["output_ids"], want(turn2), mc, "mooncake L3 across nodes")
    finally:
        launch.shutdown(h)
