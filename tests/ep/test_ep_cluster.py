"""An EP worker in a real cluster (cluster/configs/ep.yaml through launch.deploy): one colocated worker with
``workers.ep_size: 2`` is rank 0 of a 2-process EP group; HTTP /generate gives the single-process Engine's
greedy tokens; the strata-eplb actor reads the ranks' measured loads and pushes a placement that every rank
switches to while a request runs (same tokens); /metrics shows the per-rank gauges; killing the worker
ends its ranks. Config-time refusals of what an EP group cannot serve need no cluster."""
from __future__ import annotations

import dataclasses
import re
import threading
import time

import httpx
import pytest
import torch

from cluster import launch  # sets the Ray environment (loopback, no token auth) on import
from cluster.config import from_text, load_config
from engine import Engine, EngineConfig, SamplingParams
from engine.eplb import identity_placement
from tests import numerics
from tests.util import free_port

CONFIG = "cluster/configs/ep.yaml"
WID = "colocated-0"
N_NEW = 8
LONG = 48      # the request a rebalance lands in the middle of (a rebalance takes ~0.1 s, a token ~30 ms)


@pytest.mark.parametrize("yaml, field", [
    ("workers: {ep_size: 2, colocated: 1, prefill: 0, decode: 0}", "engine.eplb"),
    ("workers: {ep_size: 2, colocated: 1, prefill: 0, decode: 0}\nengine: {eplb: {num_ranks: 4}}", "num_ranks: 2"),
    ("workers: {ep_size: 2, colocated: 1, prefill: 0, decode: 0}\n"
     "engine: {enable_prefix_cache: true, hicache: {}, eplb: {num_ranks: 2}}", "engine.hicache"),
    ("workers: {ep_size: 2}\nengine: {eplb: {num_ranks: 2}}", "colocated"),
    ("workers: {ep_size: 0}", "workers.ep_size"),
])
def test_unsupported_ep_configs_are_refused_at_load(yaml, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        from_text(yaml)


def test_ep_size_must_fit_the_model():
    cfg = load_config(CONFIG)
    cfg.check_model(8)
    with pytest.raises(ValueError, match="no MoE layers"):
        cfg.check_model(0)
    with pytest.raises(ValueError, match="must divide"):
        dataclasses.replace(cfg, workers=dataclasses.replace(cfg.workers, ep_size=3),
                            engine=dataclasses.replace(cfg.engine, eplb=dataclasses.replace(
                                cfg.engine.eplb, num_ranks=3, num_redundant_experts=3))).check_model(8)


@pytest.fixture(scope="module")
def cluster():
    import ray
    cfg = load_config(CONFIG)
    # Rebalances only when the test asks (trigger); collections often, so the window holds the load.
    eplb = dataclasses.replace(cfg.engine.eplb, auto=False, collect_seconds=0.3, window=50)
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, num_pages=128, eplb=eplb),
                              workers=dataclasses.replace(cfg.workers, num_cpus=0.25),
                              server=dataclasses.replace(cfg.server, port=free_port()),
                              ray=dataclasses.replace(cfg.ray, num_cpus=2))
    launch.init_ray(cfg)
    handles = launch.deploy(cfg)
    try:
        yield handles
    finally:
        launch.shutdown(handles)
        ray.shutdown()


def _prompts() -> list[list[int]]:
    # Skewed: long runs of a few tokens send most of the routed load to a few experts.
    return [[7] * 40, [7, 9] * 20, list(range(30, 60))]


@pytest.fixture(scope="module")
def reference(cluster):
    eng = Engine(EngineConfig(model=cluster["model_path"], num_pages=128))
    memo = {}

    def check(p, n, got, what):
        if (tuple(p), n) not in memo:
            memo[tuple(p), n] = eng.generate([p], SamplingParams(max_new_tokens=n, ignore_eos=True,
                                                                 return_logits=True))[0]
        numerics.assert_same_output(got, memo[tuple(p), n], eng.model_config, f"{what}, prompt {p[:4]}")
    return check


def _generate(url: str, ids: list[int], n: int = N_NEW) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(f"{url}/generate", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["output_ids"]


@pytest.mark.numerics
def test_http_tokens_equal_single_process(cluster, reference):
    import ray
    for p in _prompts():
        reference(p, N_NEW, _generate(cluster["url"], p), "EP=2 over HTTP")
    load = ray.get(cluster["workers"][WID].expert_load.remote(), timeout=60)
    # Both ranks served pairs, and every routed pair was served by exactly one rank.
    assert load.rank_counts.shape[1] == 2 and bool((load.rank_counts.sum(0) > 0).all())
    assert torch.equal(load.rank_counts.sum(1), load.logical.sum(1))


@pytest.mark.numerics
def test_rebalancer_moves_experts_between_ranks_mid_request(cluster, reference):
    import ray
    worker, eplb, url = cluster["workers"][WID], cluster["eplb"], cluster["url"]
    out: dict = {}
    p = _prompts()[0]
    t = threading.Thread(target=lambda: out.setdefault("ids", _generate(url, p, LONG)))
    t.start()
    deadline = time.monotonic() + 30
    while ray.get(worker.load.remote()).running == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    rep = ray.get(eplb.trigger.remote(), timeout=60)
    in_flight = t.is_alive()
    t.join(timeout=120)
    assert rep is not None and rep["applied"], rep
    assert in_flight, "the rebalance did not land while the request ran"
    assert rep["moved_slots"] > 0 and rep["workers"] == 1
    reference(p, LONG, out["ids"], "EP=2, rebalanced mid-request")
    # Every rank runs the rebalancer's placement, which is not the initial one.
    want = torch.tensor(ray.get(eplb.status.remote())["phy2log"])
    got = ray.get(worker.ep_placements.remote(), timeout=60)
    assert len(got) == 2 and all(torch.equal(g, want) for g in got)
    assert not torch.equal(want, identity_placement(want.shape[0], 8, 2, 1).phy2log)
    for q in _prompts():
        reference(q, N_NEW, _generate(url, q), "EP=2 after the rebalance")


def test_metrics_show_the_live_ranks(cluster):
    import ray
    ray.get(cluster["eplb"].trigger.remote(), timeout=60)    # a fresh collection of the ranks' counters
    text = httpx.get(f"{cluster['url']}/metrics", timeout=30).text
    live = ray.get(cluster["workers"][WID].expert_load.remote(), timeout=60).rank_moe_seconds   # since
    for r in range(2):
        assert f'strata_ep_rank_tokens_last{{rank="{r}"}}' in text
        m = re.search(rf'strata_ep_rank_moe_seconds_total{{worker="{WID}",rank="{r}"}} (\S+)', text)
        assert m, text[-2000:]
        assert 0 < float(m.group(1)) <= live[r]


def test_killing_the_worker_ends_its_ranks(cluster):
    import ray
    worker = cluster["workers"][WID]
    ranks = ray.get(worker.ep_ranks.remote())
    assert len(ranks) == 1 and ray.get(ranks[0].stats.remote(), timeout=30).rank == 1
    ray.kill(worker, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(ranks[0].stats.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.2)
    pytest.fail("rank 1 outlived its worker")
