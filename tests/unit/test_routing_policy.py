"""RouterConfig.policy: prefix-aware routing against the round-robin baseline (pure, no Ray)."""
import dataclasses

import pytest

from actors.routing import PrefixIndex, RouterConfig, prompt_blocks, prompt_keys, route
from engine.worker_load import WorkerLoad
from storage.radix.node import KVEvent
from storage.geometry import KVGeometry

CFG = RouterConfig()
GEOM = KVGeometry(page_size=4, window=8)
TOKS = list(range(41))
KEYS = prompt_keys(TOKS, GEOM, CFG)
BLOCKS = prompt_blocks(TOKS, GEOM, CFG)
IDLE = {w: WorkerLoad(queued_tokens=0, running=0) for w in ("p0", "p1", "p2")}


def _index_with_prefix_on(worker: str) -> PrefixIndex:
    idx = PrefixIndex()
    idx.apply(worker, [KVEvent("stored", "L1", "full", tuple(KEYS)), KVEvent("stored", "L1", "swa", tuple(KEYS[-2:]))])
    return idx


def test_round_robin_takes_workers_in_turn_whatever_they_cache():
    rr = dataclasses.replace(CFG, policy="round_robin")
    idx = _index_with_prefix_on("p2")
    picks = [route(idx, BLOCKS, len(TOKS), IDLE, rr, GEOM, turn=t)[0] for t in range(7)]
    assert picks == ["p0", "p1", "p2", "p0", "p1", "p2", "p0"]
    # The overlap it reports is the chosen worker's own (so the hit it will get is known).
    w, ov = route(idx, BLOCKS, len(TOKS), IDLE, rr, GEOM, turn=2)
    assert w == "p2" and ov.pages == 10
    assert route(idx, BLOCKS, len(TOKS), IDLE, rr, GEOM, turn=0)[1].pages == 0


def test_prefix_policy_ignores_the_turn():
    idx = _index_with_prefix_on("p1")
    assert {route(idx, BLOCKS, len(TOKS), IDLE, CFG, GEOM, turn=t)[0] for t in range(5)} == {"p1"}


def test_policy_is_validated():
    with pytest.raises(ValueError, match="policy"):
        RouterConfig(policy="random")


def test_yaml_maps_the_policy_and_has_no_baseline_key():
    from cluster.config import from_text
    cfg = from_text("engine: {enable_prefix_cache: true, hicache: {host_pages: 64}}\nrouter: {policy: round_robin}\n")
    assert cfg.router.policy == "round_robin" and cfg.engine.hicache.host_pages == 64
    with pytest.raises(ValueError, match="swa_backup"):   # the SWA-oblivious baseline is bench-only
        from_text("engine: {enable_prefix_cache: true, hicache: {swa_backup: all}}\n")
    with pytest.raises(ValueError, match="policy"):
        from_text("router: {policy: nearest}\n")
