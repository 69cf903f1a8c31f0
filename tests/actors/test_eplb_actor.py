"""The EPLB rebalancer on a real local Ray cluster (cluster/configs/eplb.yaml: 1 prefill + 1 decode worker
with expert slots, strata-eplb on a fast schedule): a skewed workload gets a placement applied, balancedness
improves, greedy outputs stay those of Engine.generate, and `strata rebalance` works against it."""
from __future__ import annotations

import dataclasses
import threading
import time

import httpx
import pytest
import torch

from cluster import cli, launch  # launch sets the Ray environment (loopback, no token auth) on import
from cluster.config import load_config
from engine import Engine, EngineConfig, SamplingParams
from engine.eplb import ExpertLoad, Placement, PlacementApplied, balancedness, identity_placement
from tests.util import free_port
from tests import numerics

CONFIG = "cluster/configs/eplb.yaml"
N_NEW = 10


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import ray
    cfg = load_config(CONFIG)
    e = cfg.engine
    l3 = dataclasses.replace(e.hicache.l3, path=str(tmp_path_factory.mktemp("l3")))
    # The window (8 collections of 0.3 s) outlasts the schedule (2 s): the load of a burst of requests is
    # still in the window at the next scheduled evaluation, however the two happen to be phased.
    eplb = dataclasses.replace(e.eplb, collect_seconds=0.3, interval_seconds=2.0, window=8, threshold=0.95)
    engine = dataclasses.replace(e, hicache=dataclasses.replace(e.hicache, l3=l3), eplb=eplb)
    cfg = dataclasses.replace(cfg, engine=engine, server=dataclasses.replace(cfg.server, port=free_port()))
    launch.init_ray(cfg)
    handles = launch.deploy(cfg)
    yield {**handles, "cfg": cfg}
    launch.shutdown(handles)
    ray.shutdown()


def _prompts() -> list[list[int]]:
    # Skewed: long runs of a few tokens send most of the routed load to a few experts.
    g = torch.Generator().manual_seed(2)
    return [[7] * 80, [7, 9] * 40, [9] * 50 + [7] * 30, torch.randint(0, 256, (40,), generator=g).tolist()]


@pytest.fixture(scope="module")
def reference(cluster):
    eng = Engine(EngineConfig(model=cluster["model_path"], page_size=16, num_pages=512))
    sp = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True, return_logits=True)
    want = {tuple(p): o for p, o in zip(_prompts(), eng.generate(_prompts(), sp))}
    return lambda p, got: numerics.assert_same_output(got, want[tuple(p)], eng.model_config, f"prompt {p[:8]}")


def _generate(url: str, ids: list[int]) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": N_NEW, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(f"{url}/generate", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["output_ids"]


def _status(cluster) -> dict:
    import ray
    return ray.get(cluster["eplb"].status.remote(), timeout=60)


@pytest.mark.numerics
def test_schedule_applies_a_better_placement_and_outputs_do_not_change(cluster, reference):
    import ray
    url = cluster["url"]
    for p in _prompts():
        reference(p, _generate(url, p))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        st = _status(cluster)
        if st["rebalances"] >= 1:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"no rebalance on the schedule: {st}")
    last = st["last_applied"]
    assert last["applied"] and last["moved_slots"] > 0 and last["workers"] == 2
    assert sum(last["after"]) > sum(last["before"])
    # Every worker runs the rebalancer's placement now.
    want = torch.tensor(st["phy2log"])
    for w, h in cluster["workers"].items():
        r = ray.get(h.expert_load.remote(), timeout=60)
        assert torch.equal(r.phy2log, want), w
        assert int(r.logical.sum()) > 0
    # After the rebalance, the same greedy tokens; on this round's own load the new placement is more
    # balanced than the initial one.
    load0 = sum(ray.get(h.expert_load.remote(), timeout=60).logical for h in cluster["workers"].values())
    for p in _prompts():
        reference(p, _generate(url, p))
    load = sum(ray.get(h.expert_load.remote(), timeout=60).logical for h in cluster["workers"].values()) - load0
    assert int(load.sum()) > 0
    ident = identity_placement(4, 8, 4, 1)
    cur = Placement.from_phy2log(want, 8)
    assert float(balancedness(load, cur.phy2log, cur.logcnt, 4).mean()) > \
        float(balancedness(load, ident.phy2log, ident.logcnt, 4).mean())
    m = httpx.get(f"{url}/metrics", timeout=30).text
    assert "strata_eplb_rebalances_total" in m and 'strata_eplb_balancedness{layer="0"}' in m


@pytest.mark.numerics
def test_strata_rebalance_during_generations(cluster, reference, capsys):
    url = cluster["url"]
    outs: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def client(i: int, p: list[int]) -> None:
        try:
            outs[i] = _generate(url, p)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i, p)) for i, p in enumerate(_prompts() * 2)]
    for t in threads:
        t.start()
    before = _status(cluster)["rebalances"]
    assert cli.main(["rebalance", "--config", CONFIG]) == 0
    printed = capsys.readouterr().out
    assert "before" in printed and "mean" in printed
    assert "rebalanced 2 workers" in printed or "placement kept" in printed
    for t in threads:
        t.join(timeout=180)
    assert not errors, errors
    assert sorted(outs) == list(range(len(threads)))
    for i, p in enumerate(_prompts() * 2):
        reference(p, outs[i])
    st = _status(cluster)
    assert st["rebalances"] + st["skipped"] > before


def test_strata_rebalance_without_a_rebalancer(tmp_path, capsys):
    cfg = tmp_path / "other.yaml"
    cfg.write_text("ray: {namespace: strata-nobody-here}\n")
    assert cli.main(["rebalance", "--config", str(cfg)]) == 1
    assert "no EPLB rebalancer" in capsys.readouterr().err


def test_the_rebalancer_follows_the_workers_strata_scale_adds_and_removes(cluster):
    """A prefill worker added by `strata scale`: within the rebalancer's refresh from the router it is read
    and given the cluster's current placement; scaled in again, it is dropped."""
    import ray
    from actors.eplb_actor import WORKERS_REFRESH_S
    from cluster.scale import scale
    eplb = cluster["eplb"]

    def known() -> list[str]:
        return ray.get(eplb.__ray_call__.remote(lambda self: sorted(self.workers)), timeout=60)

    def wait(what, cond) -> None:
        deadline = time.monotonic() + WORKERS_REFRESH_S + 60
        while not cond():
            assert time.monotonic() < deadline, what
            time.sleep(0.2)

    out = scale(cluster["cfg"], {"prefill": 2})
    try:
        assert out.added == ["prefill-1"], out
        wait("the new worker is not followed", lambda: "prefill-1" in known())
        new = ray.get_actor("strata-prefill-1", namespace=cluster["cfg"].ray.namespace)
        wait("the new worker did not get the current placement", lambda: torch.equal(
            torch.as_tensor(ray.get(new.expert_load.remote(), timeout=60).phy2log),
            torch.as_tensor(_status(cluster)["phy2log"])))
    finally:
        back = scale(cluster["cfg"], {"prefill": 1})
    assert back.removed == ["prefill-1"]
    wait("the removed worker is still followed", lambda: known() == ["decode-0", "prefill-0"])


def test_the_rebalancer_restarts_without_its_creators_objects(cluster, capfd):
    """``start_rebalancer`` names the workers by id, not by handle: Ray keeps constructor arguments that
    hold actor handles in the creator's object store (and says so on stderr), so a restart after the
    creator (the launcher, a RayJob's driver) has gone would fail. A second rebalancer made the same way
    (its schedule idle: it must not push placements beside strata-eplb) gets no such warning, is killed,
    comes back and finds every worker by name."""
    import ray
    from actors.eplb_actor import start_rebalancer
    mc = cluster["model_config"]
    eplb = dataclasses.replace(load_config(CONFIG).engine.eplb, auto=False, collect_seconds=3600.0)
    capfd.readouterr()
    a = start_rebalancer(eplb, cluster["workers"], len(mc.moe_layer_ids), mc.num_local_experts,
                         name="strata-eplb-restart-test", router="strata-router")
    try:
        ray.get(a.status.remote(), timeout=60)
        time.sleep(0.5)   # Ray's core worker writes its warning as the creation task is submitted
        assert "constructor arguments in the object store" not in capfd.readouterr().err
        pid = ray.get(a.__ray_call__.remote(lambda self: __import__("os").getpid()), timeout=60)
        ray.kill(a, no_restart=False)
        deadline = time.monotonic() + 60
        while True:
            try:
                new_pid, found = ray.get(a.__ray_call__.remote(
                    lambda self: (__import__("os").getpid(), sorted(self.workers))), timeout=10)
                if new_pid != pid:
                    break
            except ray.exceptions.RayError:
                pass
            assert time.monotonic() < deadline, "the rebalancer did not restart"
            time.sleep(0.2)
        assert found == sorted(cluster["workers"])
    finally:
        ray.kill(a, no_restart=True)



def test_a_worker_missing_or_dead_is_said_once_and_found_again_by_name(cluster):
    """A worker the rebalancer cannot find (not made yet) or read (dead) is logged once when it goes missing,
    not on each collection (every 0.2 s here), and once when it answers again. A dead worker's handle is
    dropped, so a worker made again under its name is found. The worker here is an actor of the worker's
    name that answers the rebalancer's two calls: a real one may not be killed in this module's cluster, and
    a rebalancer beside strata-eplb must not push its placement to the real workers."""
    import ray
    from actors.eplb_actor import start_rebalancer
    mc = cluster["model_config"]
    ns = cluster["cfg"].ray.namespace
    eplb = dataclasses.replace(load_config(CONFIG).engine.eplb, auto=False, collect_seconds=0.2)
    a = start_rebalancer(eplb, ["prefill-9"], len(mc.moe_layer_ids), mc.num_local_experts,
                         name="strata-eplb-absent-test")
    phy2log = torch.tensor(ray.get(a.status.remote(), timeout=60)["phy2log"])
    reading = ExpertLoad(torch.zeros(phy2log.shape[0], mc.num_local_experts, dtype=torch.int64),
                         torch.zeros_like(phy2log), phy2log, eplb.num_ranks, 0)

    @ray.remote(num_cpus=0)
    class Worker:
        def expert_load(self):
            return reading

        def apply_placement(self, phy2log):
            return PlacementApplied(0, 0.0)

    def keep(self):
        import logging
        kept = self.kept = []

        class Keep(logging.Handler):
            def emit(self, record):
                kept.append(record.getMessage())
        logging.getLogger("strata.eplb").addHandler(Keep())
        gather, self.reads = self._gather, 0

        def counted(refs):   # once a collection
            self.reads += 1
            return gather(refs)
        self._gather = counted
        return sorted(self.absent)

    def seen():
        return ray.get(a.__ray_call__.remote(lambda self: ([m for m in self.kept if "prefill-9" in m],
                                                           self.reads, sorted(self.absent))), timeout=60)

    def wait(cond) -> tuple:
        deadline = time.monotonic() + 30
        while not cond(got := seen()):
            assert time.monotonic() < deadline, got
            time.sleep(0.1)
        return got

    def quiet(n_said: int) -> None:
        _, before, _ = seen()
        time.sleep(1.5)
        said, after, _ = seen()
        assert after - before >= 5, (before, after)
        assert len(said) == n_said, said

    w = None
    try:
        assert ray.get(a.__ray_call__.remote(keep), timeout=60) == ["prefill-9"]   # said by the constructor
        quiet(0)
        w = Worker.options(name="strata-prefill-9", namespace=ns).remote()
        said, _, _ = wait(lambda g: g[2] == [])
        assert len(said) == 1 and "answers again" in said[0], said
        ray.kill(w, no_restart=True)
        said, _, _ = wait(lambda g: g[2] == ["prefill-9"])
        assert len(said) == 2 and "did not answer" in said[1], said
        quiet(2)
        w = Worker.options(name="strata-prefill-9", namespace=ns).remote()
        said, _, _ = wait(lambda g: g[2] == [])
        assert len(said) == 3 and "answers again" in said[2], said
    finally:
        ray.kill(a, no_restart=True)
        if w is not None:
            ray.kill(w, no_restart=True)
