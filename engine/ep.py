"""One rank of an expert-parallel group (no Ray): ``EPRank`` holds an engine whose MoE layers keep only
this rank's expert slots and dispatch over the group (engine/model/moe_ep.py has the layout).

Lockstep: rank 0 (the leader) runs the scheduler, the caches and the sampler; each step it broadcasts
the batch (token ids and the paged-attention metadata, ``StepMsg``) to the other ranks, which run the same
forward on their own KV pools (same page indices: they hold the same KV) and take part in every MoE
layer's all-to-all. A rebalance is staged on every rank in the background (``stage``), then the leader
sends a control-only ``StepMsg`` with ``commit`` between two steps: every rank switches there, and a
barrier ends the pause, so no forward ever sees ranks on different placements.

Not supported in a group (ValueError): an L2 host cache (load-back fills only the leader's L1) and KV
imported from a prefill worker (only the leader's pools would hold it).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import NamedTuple

import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.attention import BatchMeta
from engine.model.moe_ep import RankCounters, SlotStager, cross_process_dispatch, keep_local_slots
from engine.runner import ModelRunner


class StepMsg(NamedTuple):
    """What the leader broadcasts before each collective step: a batch (ids [T], meta), a commit of the
    staged placement, or the end of serving."""
    ids: torch.Tensor | None
    meta: BatchMeta | None
    commit: bool = False
    stop: bool = False


class RankStats(NamedTuple):
    """Cumulative, per MoE layer [L]: pairs served here, expert compute (wall, thread CPU) seconds, whole
    dispatch seconds; steps run; slots changed and bytes moved by rebalances, and the last pause."""
    rank: int
    steps: int
    pairs: list[int]
    compute_s: list[float]
    cpu_s: list[float]
    wall_s: list[float]
    moved_slots: int
    bytes_sent: int
    bytes_received: int
    stage_seconds: float
    last_pause_seconds: float


class _LeaderRunner(ModelRunner):
    """The leader's runner: broadcasts each batch, then runs it with the others, under the group lock."""

    def __init__(self, base: ModelRunner, ep: "EPRank") -> None:
        super().__init__(base.model, base.pools, base.device)
        self.ep = ep

    def run(self, seqs):
        ids, meta = self.build_meta(seqs)
        if meta.waits:
            raise RuntimeError("EP group: a batch waits on L2 load-back, which followers cannot see")
        with self.ep.lock:
            self.ep._send(StepMsg(ids, meta))
            out = self.model(ids, meta, self.pools)
            self.ep.steps += 1
            return out


class EPRank:
    """Rank ``rank`` of ``world``. ``group``: the serving process group (None: the default one);
    ``move_group``: a second group used only for the expert moves of rebalances."""

    def __init__(self, cfg: EngineConfig, rank: int, world: int, group=None, move_group=None) -> None:
        import torch.distributed as dist
        if cfg.eplb is None or cfg.eplb.num_ranks != world:
            raise ValueError(f"EP group of {world} ranks: EngineConfig.eplb.num_ranks must be {world}")
        if cfg.hicache is not None:
            raise ValueError("EP group: hicache (L2 load-back) is not supported; set hicache to null")
        if not dist.is_initialized():
            raise ValueError("EP group: torch.distributed is not initialised")
        if dist.get_world_size(group) != world or dist.get_rank(group) != rank:
            raise ValueError(f"EP group: the process group has rank {dist.get_rank(group)} of "
                             f"{dist.get_world_size(group)}, expected {rank} of {world}")
        self.dist, self.group, self.move_group = dist, group, move_group
        self.rank, self.world = rank, world
        self.engine = Engine(dataclasses.replace(cfg, eplb=dataclasses.replace(cfg.eplb, dispatch="torch")))
        self.moes = self.engine.moe_layers
        self.counters = RankCounters(len(self.moes))
        for i, moe in enumerate(self.moes):
            keep_local_slots(moe, rank, world)
            moe.dispatch = cross_process_dispatch(cfg.eplb.dispatch, group, i, self.counters,
                                                  moe.slots.num_physical, moe.experts.gate_up_proj.shape[1])
        self.lock = threading.Lock()      # one step or control message at a time on the serving group
        self.steps = 0
        self.last_send = time.monotonic()
        self.stager: SlotStager | None = None
        self.moved_slots = self.bytes_sent = self.bytes_received = 0
        self.stage_seconds = self.last_pause = 0.0
        self._leader = dist.get_global_rank(group, 0) if group is not None else 0
        if rank == 0:
            self.engine.runner = _LeaderRunner(self.engine.runner, self)

    # ---- lockstep ------------------------------------------------------------------------------
    def _send(self, msg: StepMsg) -> None:
        self.dist.broadcast_object_list([msg], src=self._leader, group=self.group)
        self.last_send = time.monotonic()

    def keepalive(self, idle_s: float) -> bool:
        """Leader: an empty message when nothing was sent for ``idle_s`` seconds (the followers wait in
        a collective, which fails after the group's timeout: an idle server must not end its group).
        Returns whether one was sent."""
        with self.lock:
            if time.monotonic() - self.last_send < idle_s:
                return False
            self._send(StepMsg(None, None))
            return True

    def serve(self) -> int:
        """Followers: run the leader's steps until it stops the group; returns the steps run."""
        if self.rank == 0:
            raise RuntimeError("serve() is for followers; the leader steps its engine")
        while True:
            box = [None]
            self.dist.broadcast_object_list(box, src=self._leader, group=self.group)
            msg: StepMsg = box[0]
            if msg.stop:
                return self.steps
            if msg.commit:
                self._commit()
            if msg.ids is not None:
                with torch.inference_mode():
                    self.engine.model(msg.ids, msg.meta, self.engine.pools)
                self.steps += 1

    def stop(self) -> None:
        """Leader: releases the followers from ``serve``."""
        with self.lock:
            self._send(StepMsg(None, None, stop=True))

    # ---- rebalancing ---------------------------------------------------------------------------
    def stage(self, phy2log) -> int:
        """Starts this rank's moves towards phy2log [L, P] in the background; returns the moves planned
        for the whole group. Raises ValueError on a bad placement, RuntimeError while one is staged."""
        if self.stager is not None:
            raise RuntimeError("a rebalance is already staged")
        self.stager = SlotStager(self.moes, phy2log, self.rank, self.world, self.move_group).start()
        return len(self.stager.moves)

    def staged(self) -> bool:
        return self.stager is not None and self.stager.done()

    def commit(self) -> float:
        """Leader: every rank switches to the staged placement between two steps; returns the pause
        (seconds the serving group stood still)."""
        if self.rank != 0:
            raise RuntimeError("only the leader commits")
        if self.stager is None:
            raise RuntimeError("nothing staged")
        with self.lock:
            t = time.perf_counter()
            self._send(StepMsg(None, None, commit=True))
            self._commit()
            self.last_pause = time.perf_counter() - t
        return self.last_pause

    def _commit(self) -> None:
        st, self.stager = self.stager, None
        if st is None:
            raise RuntimeError(f"rank {self.rank}: commit without a staged placement")
        self.moved_slots += st.commit()
        self.bytes_sent += st.bytes_sent
        self.bytes_received += st.bytes_received
        self.stage_seconds = st.seconds
        self.dist.barrier(group=self.group)

    def placement(self) -> torch.Tensor:
        """phy2log [L, P] in force on this rank."""
        return torch.stack([m.slots.phy2log for m in self.moes]).cpu()

    def stats(self) -> RankStats:
        c = self.counters
        return RankStats(self.rank, self.steps, list(c.pairs), list(c.compute_s), list(c.cpu_s),
                         list(c.wall_s), self.moved_slots, self.bytes_sent, self.bytes_received,
                         self.stage_seconds, self.last_pause)
