"""The PD cluster over HTTP with the KV moving prefill -> decode through real Mooncake transfer engines
(tcp, P2P handshake, 127.0.0.1): greedy outputs equal Engine.generate and every pool is free afterwards.
Marked slow (a second cluster start); the fault paths are covered over NIXL in test_transfer_http.py and
for Mooncake actor to actor in test_transfer_actors.py."""
from __future__ import annotations

import dataclasses

import pytest

from cluster import launch
from cluster.config import load_config
from engine import Engine, SamplingParams
from tests.transfer.test_transfer_http import _assert_all_free, _post
from tests.util import free_port
from tests import numerics

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(ray_session):
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"mooncake transfer engine cannot load: {e!r}")
    cfg = load_config("cluster/configs/pd-1p1d-mooncake.yaml")
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, poison_kv=True),
                              server=dataclasses.replace(cfg.server, port=free_port(), request_timeout=60.0))
    handles = launch.deploy(cfg)
    yield handles
    launch.shutdown(handles)


@pytest.mark.numerics
def test_greedy_outputs_over_mooncake_equal_engine_generate(cluster):
    ref = Engine.from_pretrained(cluster["model_path"], page_size=16, num_pages=512)
    url = cluster["url"]
    for ids in ([5, 6, 7], list(range(90)), [i % 256 for i in range(3, 300)]):
        want = ref.generate([ids], SamplingParams(max_new_tokens=8, return_logits=True))[0]
        r = _post(url, ids).json()
        numerics.assert_same_output(r["output_ids"], want, ref.model_config, str(r))
    ts = ray.get(cluster["workers"]["prefill-0"].transfer_stats.remote())
    assert ts.backend == "mooncake" and ts.sends.sends == 3
    _assert_all_free(cluster)
