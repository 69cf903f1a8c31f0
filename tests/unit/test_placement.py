"""The placement policy (cluster/placement.py), the scale plan (cluster/scale.py) and the router's
registry (actors/prefix_router.py): pure, no Ray."""
import pytest

from actors.prefix_router import Router
from actors.routing import NoWorkerError, RouterConfig
from cluster.placement import NodeInfo, PlacementConfig, RolePlacement, choose_node, plan
from cluster.scale import plan as scale_plan
from engine.worker_load import WorkerLoad
from storage.geometry import KVGeometry

NODES = [NodeInfo("head", True, {"CPU": 3}, True), NodeInfo("a", True, {"CPU": 3, "gpu_pool": 1}),
         NodeInfo("b", True, {"CPU": 3})]


def test_spread_puts_one_worker_per_node_then_wraps():
    assert plan(NODES, ["prefill", "prefill", "decode", "decode"], PlacementConfig()) == ["head", "a", "b", "head"]
    assert plan(NODES[:1], ["prefill", "decode"], PlacementConfig()) == ["head", "head"]


def test_strict_spread_refuses_a_second_worker_on_a_node():
    cfg = PlacementConfig(strategy="strict_spread")
    assert plan(NODES, ["prefill", "prefill", "decode"], cfg) == ["head", "a", "b"]
    with pytest.raises(ValueError, match="strict_spread"):
        plan(NODES, ["prefill"] * 4, cfg)


def test_pack_leaves_it_to_ray_and_dead_or_unlabelled_nodes_are_skipped():
    assert plan(NODES, ["prefill"], PlacementConfig(strategy="pack")) == [None]
    cfg = PlacementConfig(prefill=RolePlacement({"gpu_pool": 1}))
    assert plan(NODES, ["prefill", "prefill", "decode"], cfg) == ["a", "a", "head"]
    dead = [NODES[0], NODES[1]._replace(alive=False), NODES[2]]
    assert choose_node(dead, {"head": 1}, {}, "spread") == "b"
    with pytest.raises(ValueError, match="no live node offers"):
        choose_node(dead, {}, {"gpu_pool": 1}, "spread")


@pytest.mark.parametrize("bad", [{"strategy": "random"}, {"prefill": {"resources": {"x": 0}}}])
def test_bad_placement_config_is_a_value_error(bad):
    from cluster.config import from_dict
    with pytest.raises(ValueError, match="placement"):
        from_dict({"placement": bad})


def test_scale_plan_fills_gaps_and_drains_the_highest_ids():
    assert scale_plan(["prefill-0", "prefill-2", "decode-0"], "prefill", 4) == (["prefill-1", "prefill-3"], [])
    assert scale_plan(["prefill-0", "prefill-1", "prefill-2"], "prefill", 1) == ([], ["prefill-2", "prefill-1"])
    with pytest.raises(ValueError, match="--decode"):
        scale_plan([], "decode", -1)


def test_router_registry_liveness_and_drain_with_time_passed_in():
    r = Router(RouterConfig(), KVGeometry(16), stale_after=5.0)
    r.report("prefill-0", "prefill", WorkerLoad(queued_tokens=0), True, now=0.0)
    r.report("prefill-1", "prefill", WorkerLoad(queued_tokens=0), True, now=0.0)
    r.report("decode-0", "decode", WorkerLoad(free_pages=10), True, now=0.0)
    assert r.route([], 32, now=1.0).prefill == "prefill-0"
    r.drain("prefill-0")
    assert {r.route([], 32, now=1.0).prefill for _ in range(3)} == {"prefill-1"}
    # silent past stale_after: no traffic, until it reports again
    r.report("prefill-1", "prefill", WorkerLoad(queued_tokens=0), False, now=6.0)
    r.report("decode-0", "decode", WorkerLoad(free_pages=10), False, now=6.0)
    assert r.status(now=6.0)["workers"]["prefill-0"]["live"] is False
    r.restore_worker("prefill-0")
    assert r.live(("prefill",), now=6.0).keys() == {"prefill-1"}
    r.report("prefill-0", "prefill", WorkerLoad(queued_tokens=0), True, now=6.5)
    assert r.live(("prefill",), now=6.5).keys() == {"prefill-0", "prefill-1"}
    r.remove_worker("decode-0")
    with pytest.raises(NoWorkerError):
        r.route([], 32, now=7.0)
