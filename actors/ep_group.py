"""An expert-parallel group of Ray actors: one ``EPRankActor`` per rank (a thin shell over engine/ep.py's
``EPRank``), created together as one worker by ``start_ep_group``, and the rendezvous.

Rendezvous: rank 0 opens a torch.distributed TCP store on 127.0.0.1 (port 0: the OS picks a free one, so
no port is guessed) and returns its port; then every rank joins at once: ``init_process_group("gloo")``
over that store, plus a second gloo group that carries only expert moves. Followers then sit in
``serve`` (the leader's steps); the leader is the group's face to the cluster: ``generate``, and the
worker protocol of the EPLB rebalancer (actors/eplb.py): ``expert_load`` (the leader's counters plus what
every rank measured: token-choice pairs and expert seconds per rank) and ``apply_placement`` (stage the
moves on every rank in the background while serving goes on, wait until all are staged, then switch all
ranks between two steps).
"""
from __future__ import annotations

import threading
import time
from typing import NamedTuple

import ray
import torch

from actors.startup_heap import freeze_startup_heap
from engine.config import EngineConfig
from engine.eplb import ExpertLoad
from engine.sampling import SamplingParams


class RebalanceReport(NamedTuple):
    """One applied placement: slots changed (all ranks), bytes sent point to point, the slowest rank's
    staging time (serving went on meanwhile) and the pause (all ranks stood still for the switch). The
    rebalancer reads ``moved_slots`` and ``seconds``, as of a single worker's ``PlacementApplied``."""
    moved_slots: int
    bytes_moved: int
    stage_seconds: float
    pause_seconds: float
    seconds: float


@ray.remote(max_concurrency=4)
class EPRankActor:
    """Rank ``rank`` of an EP group of ``world``; threaded so that stats and staging calls are answered
    while ``serve`` / ``generate`` run."""

    def __init__(self, cfg: EngineConfig, rank: int, world: int) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        self.ep = None
        self.peers: list = []
        self._store = None
        self._jobs: dict[int, dict] = {}
        self._next_job = 0
        self._apply_lock = threading.Lock()

    # ---- rendezvous ----------------------------------------------------------------------------
    def open_store(self) -> int:
        """Rank 0: the port of a fresh TCP store on 127.0.0.1."""
        self._store, port = open_store(self.world)
        return port

    def join(self, port: int, timeout_s: float = 120.0) -> int:
        self.ep = join_group(self.cfg, self.rank, self.world, port, self._store, timeout_s)
        freeze_startup_heap()   # this rank's engine is built: its startup is over
        return self.rank

    def set_peers(self, peers: list) -> None:
        """Leader: the handles of ranks 1..R-1 (for staging and their counters)."""
        self.peers = list(peers)

    # ---- followers -----------------------------------------------------------------------------
    def serve(self) -> int:
        return self.ep.serve()

    # ---- every rank ----------------------------------------------------------------------------
    def stats(self):
        return self.ep.stats()

    def stage(self, phy2log) -> int:
        return self.ep.stage(torch.as_tensor(phy2log))

    def staged(self) -> bool:
        return self.ep.staged()

    def placement(self) -> torch.Tensor:
        return self.ep.placement()

    # ---- leader --------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        return [o.token_ids for o in self.ep.engine.generate(prompts, params)]

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> int:
        """Starts ``generate`` in the background (requests are added now); returns a job id for ``result``."""
        eng = self.ep.engine
        rids = [eng.add_request(p, params) for p in prompts]
        job = self._next_job
        self._next_job += 1
        self._jobs[job] = {"rids": rids, "done": threading.Event()}

        def run() -> None:
            from engine.request import Status
            while any(eng.requests[r].status is not Status.FINISHED for r in rids):
                eng.step()
            self._jobs[job]["tokens"] = [eng.pop_finished(r).token_ids for r in rids]
            self._jobs[job]["done"].set()

        threading.Thread(target=run, name=f"ep-job-{job}", daemon=True).start()
        return job

    def tokens_so_far(self, job: int) -> int:
        eng = self.ep.engine
        return sum(len(eng.requests[r].output_ids) for r in self._jobs[job]["rids"] if r in eng.requests)

    def result(self, job: int, timeout_s: float = 120.0) -> list[list[int]]:
        if not self._jobs[job]["done"].wait(timeout_s):
            raise TimeoutError(f"EP job {job} did not finish in {timeout_s}s")
        return self._jobs.pop(job)["tokens"]

    def expert_load(self) -> ExpertLoad:
        """The rebalancer's reading (actors/eplb.py ``observe``): the leader's logical and slot counters,
        and each rank's measured pairs [L, R] and expert compute seconds [R], all cumulative."""
        return group_reading(self.ep, ray.get([p.stats.remote() for p in self.peers]))

    def apply_placement(self, phy2log, poll_s: float = 0.002) -> RebalanceReport:
        """Moves the group to phy2log [L, P]: every rank stages its moves in the background (serving goes
        on), then all switch between two steps."""
        with self._apply_lock:
            t = time.perf_counter()
            phy2log = check_placement(self.ep, phy2log)
            before = [self.ep.stats()] + ray.get([p.stats.remote() for p in self.peers])
            # Followers first (they only post sends/receives), then the leader; all run concurrently.
            refs = [p.stage.remote(phy2log) for p in self.peers]
            self.ep.stage(phy2log)
            ray.get(refs)
            while not (self.ep.staged() and all(ray.get([p.staged.remote() for p in self.peers]))):
                time.sleep(poll_s)
            pause = self.ep.commit()
            after = [self.ep.stats()] + ray.get([p.stats.remote() for p in self.peers])
            return rebalance_report(before, after, pause, t)

    def keepalive(self, idle_s: float) -> bool:
        """Leader: an empty step message if nothing was sent for ``idle_s`` (EPRank.keepalive)."""
        return self.ep.keepalive(idle_s)

    def stop(self) -> None:
        self.ep.stop()


# ---- shared by the rank actors and a worker hosting a group (actors/ep_host.py) ----------------------

def open_store(world: int):
    """A fresh TCP store on 127.0.0.1 for ``world`` ranks (port 0: the OS picks a free one) -> (store, port)."""
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False)
    return store, store.port


def join_group(cfg: EngineConfig, rank: int, world: int, port: int, store=None, timeout_s: float = 120.0):
    """This process joins the group as ``rank`` (``store``: rank 0's own, else it connects to ``port``):
    the gloo serving group, a second gloo group for expert moves, and the rank's engine. -> EPRank."""
    import datetime

    import torch.distributed as dist
    from engine.ep import EPRank
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    store = store or dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    moves = dist.new_group(backend="gloo")
    return EPRank(cfg, rank, world, None, moves)


def group_reading(ep, peer_stats: list) -> ExpertLoad:
    """The leader's reading for the rebalancer (engine/eplb.py ``ExpertLoad``) from its EPRank ``ep`` and
    the followers' RankStats."""
    stats = [ep.stats()] + list(peer_stats)
    return ep.engine.expert_reading()._replace(
        rank_counts=torch.tensor([s.pairs for s in stats], dtype=torch.int64).T.contiguous(),
        rank_moe_seconds=[sum(s.compute_s) for s in stats], rank_moe_cpu_seconds=[sum(s.cpu_s) for s in stats])


def check_placement(ep, phy2log) -> torch.Tensor:
    """phy2log [L, P] as int64 once it is a valid placement of the group's shape; ValueError before any
    rank stages anything (a rank that staged would wait forever for moves the others never post)."""
    from engine.eplb import Placement
    phy2log = torch.as_tensor(phy2log).to(torch.int64)
    cur = ep.placement()
    if phy2log.shape != cur.shape:
        raise ValueError(f"placement of shape {tuple(phy2log.shape)}, the group has {tuple(cur.shape)}")
    E = ep.engine.model_config.num_local_experts
    if ((phy2log < 0) | (phy2log >= E)).any():
        raise ValueError(f"placement holds an expert id outside [0, {E})")
    Placement.from_phy2log(phy2log, E).check()
    return phy2log


def rebalance_report(before: list, after: list, pause: float, t0: float) -> RebalanceReport:
    """RebalanceReport from every rank's RankStats before and after."""
    return RebalanceReport(sum(a.moved_slots - b.moved_slots for a, b in zip(after, before)),
                           sum(a.bytes_sent - b.bytes_sent for a, b in zip(after, before)),
                           max(a.stage_seconds for a in after), pause, time.perf_counter() - t0)


def create_ep_group(cfg: EngineConfig, world: int, num_cpus: float = 0.25) -> list:
    """Creates the ``world`` rank actors of one EP group without waiting for them (their processes start
    meanwhile; ``join_ep_group`` joins them); leader first. ``cfg.eplb.num_ranks`` must be ``world``."""
    if cfg.eplb is None or cfg.eplb.num_ranks != world:
        raise ValueError(f"an EP group of {world} ranks needs EngineConfig.eplb.num_ranks == {world}")
    return [EPRankActor.options(num_cpus=num_cpus).remote(cfg, r, world) for r in range(world)]


def join_ep_group(ranks: list, timeout_s: float = 120.0) -> list:
    """The rendezvous: rank 0's store, every rank into the gloo groups, followers serving. -> ranks."""
    port = ray.get(ranks[0].open_store.remote(), timeout=timeout_s)
    ray.get([a.join.remote(port, timeout_s) for a in ranks], timeout=timeout_s + 60)
    ray.get(ranks[0].set_peers.remote(ranks[1:]))
    for a in ranks[1:]:
        a.serve.remote()
    return ranks


def start_ep_group(cfg: EngineConfig, world: int, num_cpus: float = 0.25, timeout_s: float = 120.0) -> list:
    """``create_ep_group`` then ``join_ep_group``: a serving EP group; its handles, leader first."""
    return join_ep_group(create_ep_group(cfg, world, num_cpus), timeout_s)


def stop_ep_group(ranks: list) -> None:
    """Releases the followers and ends every rank actor."""
    try:
        ray.get(ranks[0].stop.remote(), timeout=30)
    finally:
        for a in ranks:
            ray.kill(a)
