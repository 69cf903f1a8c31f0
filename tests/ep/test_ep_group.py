"""Expert parallelism with real processes: EP groups of 1, 2 and 4 Ray rank actors joined over gloo
(actors/ep_group.py) produce the greedy tokens of the single-process Engine (numerics policy), before,
during (a rebalance committed while generations run) and after rebalances that move expert weights
between the ranks."""
from __future__ import annotations

import time

import pytest
import torch

from cluster import launch  # noqa: F401  (sets the Ray environment: loopback, no token auth)
from engine import Engine, EngineConfig, SamplingParams
from engine.eplb import EplbConfig, Placement, identity_placement, rebalance
from tests import numerics

PROMPTS = [[7] * 12, [1, 2, 3, 4, 5, 6, 7, 8, 9], list(range(30, 50))]
N_NEW = 6


def ep_config(world: int) -> EngineConfig:
    return EngineConfig(model="strata-tiny", num_pages=128, torch_threads=1, max_running_requests=8,
                        eplb=EplbConfig(num_ranks=world, num_redundant_experts=world, interval_steps=1))


@pytest.fixture(scope="module")
def groups():
    import ray
    from actors.ep_group import create_ep_group, join_ep_group, stop_ep_group
    launch.start_local_ray(num_cpus=2)
    made = {}
    try:
        # All three groups start together: their processes build their engines concurrently.
        made = {w: create_ep_group(ep_config(w), w, num_cpus=0.25) for w in (1, 2, 4)}
        for ranks in made.values():
            join_ep_group(ranks)
        yield made
    finally:
        for ranks in made.values():
            stop_ep_group(ranks)
        ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    eng = Engine(EngineConfig(model="strata-tiny", num_pages=128))
    memo = {}

    def check(prompts, n_new, got, what):
        key = (tuple(map(tuple, prompts)), n_new)
        if key not in memo:
            memo[key] = eng.generate(prompts, SamplingParams(max_new_tokens=n_new, ignore_eos=True,
                                                             return_logits=True))
        for p, toks, want in zip(prompts, got, memo[key]):
            numerics.assert_same_tokens(toks, want.token_ids, want.logits, eng.model_config,
                                        f"{what}, prompt {p[:4]}")
    return check


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


@pytest.mark.numerics
@pytest.mark.parametrize("world", [1, 2, 4])
def test_tokens_equal_single_process(groups, reference, world):
    import ray
    leader = groups[world][0]
    got = ray.get(leader.generate.remote(PROMPTS, greedy(N_NEW)), timeout=120)
    reference(PROMPTS, N_NEW, got, f"EP={world}")
    load = ray.get(leader.expert_load.remote())
    # Every (token, choice) pair was served by exactly one rank, and each rank served only its own slots.
    assert torch.equal(load.rank_counts.sum(1), load.logical.sum(1))
    assert torch.equal(load.rank_counts, load.slot_counts.view(load.slot_counts.shape[0], world, -1).sum(-1))
    assert load.rank_counts.shape[1] == world and (load.rank_counts.sum(0) > 0).sum() >= min(world, 2)


def _skewed_placement(leader, world: int) -> torch.Tensor:
    """The reference policy's placement for a load that puts most tokens on experts 0 and 1."""
    import ray
    cur = ray.get(leader.placement.remote())
    L, P = cur.shape
    w = torch.ones(L, 8)
    w[:, 0], w[:, 1] = 40, 20
    new = Placement(*rebalance(w, P, 1, 1, world)).phy2log
    assert not torch.equal(new, cur)
    return new


@pytest.mark.numerics
@pytest.mark.parametrize("world", [2, 4])
def test_rebalance_during_generation_keeps_tokens(groups, reference, world):
    import ray
    ranks = groups[world]
    leader = ranks[0]
    n_new = 24
    job = ray.get(leader.submit.remote(PROMPTS, greedy(n_new)))
    deadline = time.monotonic() + 60
    while ray.get(leader.tokens_so_far.remote(job)) < len(PROMPTS) and time.monotonic() < deadline:
        time.sleep(0.01)
    new = _skewed_placement(leader, world)
    rep = ray.get(leader.apply_placement.remote(new), timeout=60)
    done_at_switch = ray.get(leader.tokens_so_far.remote(job))
    got = ray.get(leader.result.remote(job), timeout=120)
    assert 0 < done_at_switch < len(PROMPTS) * n_new, "the switch did not land in the middle of the generations"
    assert rep.moved_slots > 0 and rep.bytes_moved > 0 and rep.pause_seconds >= 0
    for r in ranks:                                    # every rank switched
        assert torch.equal(ray.get(r.placement.remote()), new)
    reference(PROMPTS, n_new, got, f"EP={world}, rebalanced mid-generation")
    # After: the new placement serves, and a second rebalance (back) keeps the tokens too.
    reference(PROMPTS, N_NEW, ray.get(leader.generate.remote(PROMPTS, greedy(N_NEW))), f"EP={world} after")
    back = identity_placement(new.shape[0], 8, world, 1).phy2log
    ray.get(leader.apply_placement.remote(back), timeout=60)
    reference(PROMPTS, N_NEW, ray.get(leader.generate.remote(PROMPTS, greedy(N_NEW))), f"EP={world} back")


@pytest.mark.numerics
def test_keepalive_messages_leave_the_group_serving(groups, reference):
    import ray
    leader = groups[2][0]
    # An idle leader's empty message (what keeps followers out of the gloo timeout) is taken and skipped.
    assert ray.get(leader.keepalive.remote(0.0)) and not ray.get(leader.keepalive.remote(3600.0))
    reference(PROMPTS, N_NEW, ray.get(leader.generate.remote(PROMPTS, greedy(N_NEW))), "EP=2 after a keepalive")
