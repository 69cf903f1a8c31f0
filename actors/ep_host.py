"""A worker that serves through an expert-parallel group (``workers.ep_size`` > 1): the WorkerActor
process itself is rank 0, the leader, and ``EPHost`` creates and drives ranks 1..R-1 (EPRankActors,
actors/ep_group.py) beside it.

Why the worker is the leader rather than a client of a rank-0 actor: the leader is where the scheduler,
the caches and the sampler run, which is exactly what WorkerActor's AsyncEngine drives. With the
worker's own engine replaced by rank 0's (``EPRank.engine``, whose runner broadcasts each batch to the
followers before running it), every WorkerActor method (generate, load, stats, router reports, drain)
works unchanged, streams stay in-process, and only ``expert_load`` / ``apply_placement`` differ.

Lifetime: the followers are created by the worker, so Ray fate-shares them with it: killing (or
restarting) the worker ends its ranks, and a restarted worker builds a new group. They are pinned to the
worker's node (hard node affinity): the rendezvous store listens on 127.0.0.1.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.ep_group import (EPRankActor, RebalanceReport, check_placement, group_reading, join_group, open_store,
                             rebalance_report)
from engine.config import EngineConfig
from engine.eplb import ExpertLoad

log = logging.getLogger("strata.ep")


class EPHost:
    """Rank 0 of a group of ``world`` in this process, and the handles of the others. Build it in the
    worker's constructor (it blocks until every rank has joined)."""

    def __init__(self, cfg: EngineConfig, world: int, num_cpus: float, num_gpus: float = 0.0,
                 timeout_s: float = 120.0, poll_s: float = 0.002) -> None:
        if world < 2:
            raise ValueError(f"an EP group needs ep_size >= 2, got {world}")
        self.cfg, self.world, self.poll_s = cfg, world, poll_s
        node = ray.get_runtime_context().get_node_id()
        store, port = open_store(world)
        self.peers = [EPRankActor.options(
            num_cpus=num_cpus, num_gpus=num_gpus,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(cfg, r, world)
            for r in range(1, world)]
        joined = [p.join.remote(port, timeout_s) for p in self.peers]
        try:
            self.ep = join_group(cfg, 0, world, port, store, timeout_s)   # returns once all have joined
            ray.get(joined, timeout=timeout_s)
        except BaseException:
            for p in self.peers:
                ray.kill(p)
            raise
        for p in self.peers:
            p.serve.remote()
        self._apply = asyncio.Lock()
        # Idle followers wait in a broadcast that times out after timeout_s: keep them fed.
        self._idle_s = timeout_s / 4
        threading.Thread(target=self._keepalive, name="strata-ep-keepalive", daemon=True).start()

    def _keepalive(self) -> None:
        while True:
            time.sleep(self._idle_s / 2)
            try:
                self.ep.keepalive(self._idle_s)
            except Exception as e:  # noqa: BLE001 - a broken group fails the next step loudly
                log.warning("EP keepalive failed: %r", e)
                return

    def engine_config(self, cfg: EngineConfig) -> EngineConfig:
        """``cfg`` (the running engine's) with the group's own expert dispatch choice (rank 0's engine runs
        the torch path locally and dispatches across the ranks itself)."""
        return dataclasses.replace(cfg, eplb=self.cfg.eplb)

    @property
    def engine(self):
        return self.ep.engine

    async def _peer_stats(self) -> list:
        return list(await asyncio.gather(*(p.stats.remote() for p in self.peers)))

    async def expert_load(self, core) -> ExpertLoad:
        """The rebalancer's reading: the leader's counters (read on the engine thread, between steps)
        plus every rank's measured pairs [L, R] and expert seconds [R]."""
        stats = await self._peer_stats()
        return await core.call(lambda e: group_reading(self.ep, stats))

    async def apply_placement(self, core, phy2log) -> RebalanceReport:
        """Every rank stages its moves in the background while serving goes on; once all are staged the
        engine thread commits between two steps (all ranks switch together)."""
        async with self._apply:
            t = time.perf_counter()
            phy2log = check_placement(self.ep, phy2log)
            before = [self.ep.stats()] + await self._peer_stats()
            staged = [p.stage.remote(phy2log) for p in self.peers]
            self.ep.stage(phy2log)
            await asyncio.gather(*staged)
            while not (self.ep.staged() and all(await asyncio.gather(*(p.staged.remote() for p in self.peers)))):
                await asyncio.sleep(self.poll_s)
            pause = await core.call(lambda e: self.ep.commit())
            return rebalance_report(before, [self.ep.stats()] + await self._peer_stats(), pause, t)

    async def placements(self) -> list[torch.Tensor]:
        """phy2log [L, P] in force on each rank, leader first."""
        return [self.ep.placement()] + list(await asyncio.gather(*(p.placement.remote() for p in self.peers)))
