"""Ray shells over one worker's AsyncEngine: prefill, decode, or colocated (both). With ``ep_size`` > 1
a colocated worker serves through an expert-parallel group whose rank 0 it is (actors/ep_host.py).

Each worker publishes its tree's KV events, L1 and L2, on the field's KV-event wire (storage/kv_events/:
its own ZMQ PUB + replay sockets; ``kv_events_endpoint()`` says where), which is what the router's index
reads, and forwards its L3 writes to the L3 store's publisher. Every ``report_interval`` seconds it reports
its load to the router with where its stream stands, over the router's route channel (no Ray call; over
Ray while the channel is down); the first report after a (re)start says ``fresh`` so the router forgets
what a previous incarnation held and reads the new stream from its start.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, AsyncIterator

import ray
import zmq
import zmq.asyncio
from ray.actor import ActorHandle

from actors.cpu_binding import bind_worker
from actors.handoff import PeerFailed, Reservation, prefill_reserving
from actors.route_channel import ChannelDown, ReportClient
from actors.startup_heap import freeze_startup_heap
from actors.token_channel import (ChannelClient, ChannelLost, ChannelServer, Handoff, Leased, LeasedSender, Reserve,
                                  Route, StaleChannel)
from engine.config import EngineConfig
from engine.sampling import SamplingParams
from engine.stream import StreamItem
from engine.worker_load import WorkerLoad
from storage.kv_events import (KVEventPublisher, KVEventsConfig, KVEventsEndpoint, StreamPosition, TreeEventStream,
                               WireMapping, worker_media)
from storage.transfer import Destination, TransferConfig, TransferError, make_backend
from storage.transfer.base import Receipt, SendStats, TransferStats
from storage.transfer.sends import SendRecord

if TYPE_CHECKING:
    from actors.ep_group import RebalanceReport
    from engine.engine import Engine
    from engine.eplb import ExpertLoad, PlacementApplied

log = logging.getLogger("strata.worker")
MAX_EARLY_ABORTS = 4096   # routes whose ABORT came before their decode half, kept to refuse it (oldest go)
REPORT_CHANNEL_RETRY_S = 2.0   # how often a worker reporting over Ray asks the router for its channel again


@ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=1000)
class WorkerActor:
    def __init__(self, worker_id: str, role: str, engine_cfg: EngineConfig, router=None,
                 report_interval: float = 0.05, transfer_cfg: TransferConfig | None = None, storage=None,
                 l3_refresh_s: float = 2.0, ep_size: int = 1, ep_num_cpus: float = 0.25,
                 ep_num_gpus: float = 0.0, kv_events: KVEventsConfig | None = None,
                 served_name: str | None = None, cpu_binding: str = "auto") -> None:
        if role not in ("prefill", "decode", "colocated"):
            raise ValueError(f"role must be prefill, decode or colocated, got {role!r}")
        if ep_size > 1 and role != "colocated":
            raise ValueError(f"ep_size {ep_size}: only colocated workers serve through an EP group")
        self.worker_id, self.role = worker_id, role
        # Before any thread of ours starts, so they all inherit it (actors/cpu_binding.py).
        self.cores = bind_worker(cpu_binding, engine_cfg.torch_device.type, engine_cfg.torch_threads, ep_size)
        # The router and the storage actor by name (cluster/workers.py passes names): a handle among the
        # constructor arguments, to an actor still being created, is an object Ray keeps for restarts and
        # logs an error about; a name is plain config, and a restarted worker finds them again.
        ns = ray.get_runtime_context().namespace
        router = ray.get_actor(router, namespace=ns) if isinstance(router, str) else router
        storage = ray.get_actor(storage, namespace=ns) if isinstance(storage, str) else storage
        engine_cfg, transfer_cfg = resolve_hosts(engine_cfg, transfer_cfg)
        # The engine's modules (torch) load here, not with this module: Ray loads an actor's class in every
        # process that receives a handle to it, and the ingress, which holds the workers', needs no torch.
        from actors.ep_host import EPHost
        from engine.async_engine import AsyncEngine
        from engine.engine import Engine
        # ep_size > 1: this process is rank 0 of the group, and the engine it serves is that rank's.
        self.ep = EPHost(engine_cfg, ep_size, ep_num_cpus, ep_num_gpus) if ep_size > 1 else None
        self.core = AsyncEngine(self.ep.engine if self.ep is not None else Engine(engine_cfg), worker_id)
        # The token channel (actors/token_channel.py), on this node's address as the KV events are: the
        # items of the ingress's requests go out on it, one message per step and ingress replica, and its
        # requests to this worker alone come in on it (no Ray call: _channel_request), and so do the P/D
        # requests it prefills (_channel_handoff), whose lease it reserves on the decode worker over that
        # worker's channel (RESERVE: _channel_reserve there) and whose decode half it hands on there too
        # (LEASED: _channel_leased there). A colocated worker's engine thread reads those requests itself
        # (its inbox), so a request wakes that thread alone. Prefill and decode workers keep the channel's
        # own request thread: with the inbox, 5 of 6 1P+1D bench runs had the 64-token request slower
        # (session 27), and so did 3 of 4 paired runs of session 28 (README), by 30-45 ms in ~0.5 s with the
        # decode engine thread's CPU and run-queue wait unchanged, for a reason not found yet.
        self.channel = ChannelServer(channel_host(kv_events), on_request=self._channel_request,
                                     on_abort=self._channel_abort, on_handoff=self._channel_handoff,
                                     on_leased=self._channel_leased, on_reserve=self._channel_reserve,
                                     read_requests=role != "colocated")
        self._loop: asyncio.AbstractEventLoop | None = None   # the actor's event loop (channel_endpoints)
        self._handoffs: dict[Route, asyncio.Task] = {}         # P/D requests from the channel, by route
        self._aborted: OrderedDict[Route, None] = OrderedDict()   # ABORTs that came before their request
        self.leased_out = LeasedSender()                      # decode halves to the decode workers
        # This prefill worker's own channels to its decode workers (a DEALER each, made on the actor's loop
        # at the first handoff to one), by (endpoint, requests endpoint): where its reserves go and their
        # answers come from.
        self._decode_channels: dict[tuple[str, str], asyncio.Task] = {}
        self._zctx = None
        self.core.on_step = self.channel.send_step
        if self.channel.requests is not None:
            self.core.set_inbox(self.channel.requests)
        self.router = router
        self.report_interval = report_interval
        # The report thread's own DEALER to the router's route channel (no Ray call per report); None
        # until opened, or after it was lost (reports then go over Ray until it is opened again).
        self._reports: ReportClient | None = None
        self._reports_tried = float("-inf")
        # A thread, started here, so a restarted actor reports again without anyone calling it.
        self._stop = threading.Event()
        self._flush_ack: threading.Event | None = None   # set once a report told the router of a flush
        self._cleared: threading.Event | None = None     # the flush whose AllBlocksCleared is published
        self.kv_events = self._kv_events(kv_events, served_name)
        # L3 is the storage actor's to publish: this worker forwards the L3 writes its tree records.
        self.l3_events_to = storage if storage is not None and kv_events is not None and kv_events.enabled else None
        self._l3_cleared_by: threading.Event | None = None   # the flush (its ack) that cleared L3
        self._l3_position: StreamPosition | None = None       # where the L3 stream stood after our writes
        self._reporting = router is not None or self.kv_events is not None or self.l3_events_to is not None
        if self._reporting:
            threading.Thread(target=self._report_loop, name="strata-report", daemon=True).start()
        # Prefill->decode transfer (storage/transfer): the backend end of this worker, and on the decode
        # side a sweep that frees the pages of expired leases even when nobody calls.
        self.tcfg = transfer_cfg or TransferConfig()
        self.transfer = None
        self.sends = SendRecord()
        # The peers' actor handles by worker id (the prefill workers that send here, the decode workers this
        # one sends to): storage/ and engine/ name a peer by its id only.
        self.peers: dict[str, ActorHandle] = {}
        if role != "colocated":
            self.transfer = make_backend(self.tcfg, role, self.core.engine.pools, f"strata-{worker_id}-{uuid.uuid4().hex[:8]}")
            self.transfer.on_send_ended = self._send_ended
        if role == "decode" or (role == "prefill" and self.transfer.one_sided):
            threading.Thread(target=self._transfer_loop, name="strata-transfer", daemon=True).start()
        # Mooncake L3: pages go to the storage actor's segment, which is new after that actor restarts (and
        # a restarted worker was built with the first one): follow it, or new pages would land in the
        # workers' own small segments and vanish with them.
        l3 = self.core.engine.cache.l3
        if storage is not None and l3 is not None and hasattr(l3.store, "prefer_segment"):
            threading.Thread(target=self._l3_segment_loop, args=(storage, l3.store, l3_refresh_s),
                             name="strata-l3-segment", daemon=True).start()
        freeze_startup_heap()

    def __ray_shutdown__(self) -> None:
        """A graceful exit (Ray calls this): stop the threads, close the sockets, give up the seat."""
        self._stop.set()
        if self.cores is not None:
            self.cores.close()   # the other workers on this machine see one fewer at their next look
        if self.channel.requests is not None:
            self.core.detach_inbox(self.channel.requests)
        self.channel.close()
        self.leased_out.close()
        for t in self._decode_channels.values():
            if t.done() and not t.cancelled() and t.exception() is None:
                t.result().close()
        if self.kv_events is not None:
            try:
                self.kv_events.close()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass

    async def start(self) -> dict:
        mc = self.core.engine.model_config
        ep = self.kv_events.endpoint if self.kv_events is not None else None
        return {"worker_id": self.worker_id, "role": self.role, "vocab_size": mc.vocab_size,
                "max_context": mc.max_position_embeddings, "model_path": str(self.core.engine.model_path),
                "kv_events": ep._asdict() if ep is not None else None,
                "cores": self.cores.cores if self.cores is not None else None}

    def _kv_events(self, cfg: KVEventsConfig | None, served_name: str | None) -> TreeEventStream | None:
        """This worker's publisher on the KV-event wire (None when disabled, or when no port is free: the
        Ray reports to the router do not depend on it)."""
        if cfg is None or not cfg.enabled:
            return None
        eng = self.core.engine
        host = ray.util.get_node_ip_address() if cfg.host == "auto" else cfg.host
        try:
            pub = KVEventPublisher(cfg, served_name or str(eng.cfg.model), host)
        except OSError as e:
            log.warning("%s: not publishing KV events: %s", self.worker_id, e)
            return None
        return TreeEventStream(pub, WireMapping.of(eng.cfg.page_size, eng.geometry.window or 0,
                                                   worker_media(cfg.l1_medium)))

    async def cached_blocks(self) -> dict[str, dict[str, list[int]]]:
        """The wire's block ids of what this worker's tree holds, by tier (L1, L2: its own) and component:
        what its KV-event stream has said so far, summed up (audits of a consumer's index against it)."""
        def blocks(e: Engine) -> dict[str, dict[str, list[int]]]:
            out: dict[str, dict[str, set[int]]] = {}
            for ev in e.cache.snapshot_events():
                if ev.tier in ("L1", "L2"):
                    out.setdefault(ev.tier, {}).setdefault(ev.component, set()).update(
                        int.from_bytes(k[:8], "big") for k in ev.page_keys)
            return {t: {c: sorted(v) for c, v in d.items()} for t, d in out.items()}
        return await self.core.call(blocks)

    async def kv_events_endpoint(self) -> KVEventsEndpoint | None:
        """Where this worker publishes its KV events (topic, PUB and replay addresses), None when it
        does not."""
        return self.kv_events.endpoint if self.kv_events is not None else None

    def _publish(self, events: list, flushed: threading.Event | None, snapshot: list | None) -> None:
        """The batch just taken, on the wire: published once as taken, a flush's AllBlocksCleared once per
        flush, then the ``snapshot`` the router asked for (when it did). Nothing is admitted between a flush
        and its ack (flush_hold), so no store made after the flush shares its batch."""
        cleared = flushed is not None and flushed is not self._cleared
        try:
            self.kv_events.publish(events, time.time(), cleared)
            if snapshot is not None:
                self.kv_events.snapshot(snapshot, time.time())
        except Exception as e:  # noqa: BLE001 - the wire must not stop the reports; its seq shows the gap
            log.warning("publishing KV events failed: %r", e)
            return
        if cleared:
            self._cleared = flushed

    def _forward_l3(self, events: list, flushed: threading.Event | None) -> None:
        """The L3 writes this tree recorded, to the L3 store's publisher (and a flush's clear of L3, after
        the writes before it); ``_l3_position`` is then where the L3 stream stands, for the router."""
        l3 = [e for e in events if e.tier == "L3" and e.kind == "stored"]
        if l3:
            self._l3_position = ray.get(self.l3_events_to.l3_stored.remote(l3), timeout=10) or self._l3_position
        if flushed is not None and flushed is self._l3_cleared_by:
            self._l3_position = ray.get(self.l3_events_to.l3_cleared.remote(), timeout=10) or self._l3_position
            self._l3_cleared_by = None

    def _report_loop(self) -> None:
        """Every ``report_interval``: the tree's new events on the wire, then load and liveness to the
        router with where this worker's stream (and the L3 store's) stands, so that when the report returns
        the router has applied them. A report that fails is resent as ``fresh`` (the router may have
        restarted: it reads the stream again from its start)."""
        fresh, resync = True, False
        while not self._stop.wait(self.report_interval):
            # Taken before the events: a flush that asked (flush_cache) is over, so its removals are among
            # them, and every report before this one carried only what came before the flush.
            flushed, self._flush_ack = self._flush_ack, None
            try:
                if resync:   # the pending events, then everything the tree holds, in one engine step
                    new, snapshot = self.core.call_blocking(
                        lambda e: (e.cache.take_events(), e.cache.snapshot_events()))
                else:
                    new, snapshot = self.core.call_blocking(lambda e: e.cache.take_events()), None
                if self.kv_events is not None:
                    self._publish(new, flushed, snapshot)
                resync = False
                if self.l3_events_to is not None:
                    try:
                        self._forward_l3(new, flushed)
                    except Exception as e:  # noqa: BLE001 - the L3 store restarting must not stop the reports
                        log.warning("forwarding L3 events failed: %r", e)
                if self.router is not None:
                    position = self.kv_events.position() if self.kv_events is not None else None
                    reply = self._report(fresh, position)
                    fresh, resync = reply.ignored, reply.resync
                if flushed is not None:
                    flushed.set()
            except Exception as e:  # the router may be restarting: resend as fresh
                log.warning("report to router failed: %r", e)
                fresh = True
                self._flush_ack = self._flush_ack or flushed
        if self._reports is not None:
            self._reports.close()

    def _report(self, fresh: bool, position: StreamPosition | None):
        """One report to the router: over its route channel, or over Ray while there is none (the router
        has none, or it was lost: a restarted router binds anew, so its endpoint is asked again, at most
        every REPORT_CHANNEL_RETRY_S). Returns its ReportReply."""
        args = (self.worker_id, self.role, self.core.load(), fresh, position, self._l3_position)
        now = time.monotonic()
        if self._reports is None and now - self._reports_tried >= REPORT_CHANNEL_RETRY_S:
            self._reports_tried = now
            endpoint = ray.get(self.router.route_endpoint.remote(), timeout=10)
            self._reports = ReportClient(endpoint) if endpoint else None
        if self._reports is not None:
            try:
                return self._reports.report(*args)
            except ChannelDown as e:
                log.warning("report over the route channel failed, sent over Ray: %s", e)
                self._reports = None
        return ray.get(self.router.report.remote(*args), timeout=10)

    def _transfer_loop(self) -> None:
        """The P/D upkeep nobody calls for: on the decode side, expire leases and ask the senders of
        quarantined ones whether their send may still write; on a one-sided prefill side, finish off the
        sends that could not be aborted."""
        while not self._stop.wait(self.tcfg.expiry_interval if self.role == "decode" else 0.2):
            try:
                if self.role == "decode":
                    self._sweep_leases()
                else:
                    self.transfer.reap()
            except Exception as e:  # noqa: BLE001 - keep sweeping
                log.warning("transfer upkeep failed: %r", e)

    def _sweep_leases(self) -> None:
        sweep = self.core.call_blocking(lambda e: e.receiver.tick(time.monotonic()))
        for lease_id in sweep.expired:
            self.transfer.forget(lease_id)
            log.warning("transfer lease %s expired%s", lease_id,
                        ": its pages stay quarantined until its sender's send is over"
                        if lease_id in sweep.quarantined else ": its pages are free again")
        for lease_id, sender in sweep.probe:
            self._probe(lease_id, sender)

    def _probe(self, lease_id: str, sender: str) -> None:
        """A sender that says its send into ``lease_id`` cannot write any more, or is dead (a restart is a
        new process: the old one's transfers died with it), frees the quarantined pages."""
        handle = self._peer(sender)
        if handle is None:
            return
        try:
            pending = ray.get(handle.send_pending.remote(lease_id), timeout=5)
        except ray.exceptions.GetTimeoutError:
            return       # hung, not dead: keep the pages
        except ray.exceptions.RayError:
            pending = False
        if not pending and self.core.call_blocking(lambda e: e.receiver.release(lease_id)):
            log.warning("quarantined lease %s released: its sender has no send in flight", lease_id)

    def _send_ended(self, lease_id: str) -> None:
        """A send that could not be aborted is over (a backend thread): tell its decode worker."""
        self._tell_ended(self.sends.end(lease_id), lease_id)

    def _tell_ended(self, decode: str | None, lease_id: str) -> None:
        handle = self._peer(decode) if decode else None
        if handle is not None:
            handle.transfer_ended.remote(lease_id)

    def _l3_segment_loop(self, storage, store, every: float) -> None:
        wait = 0.0
        while not self._stop.wait(wait):
            wait = every
            try:
                seg = ray.get(storage.worker_segment.remote(), timeout=10)
            except Exception as e:  # noqa: BLE001 - restarting: keep the segment we have, ask again
                log.debug("storage actor unreachable: %r", e)
                continue
            if seg and seg != store.preferred_segment:
                log.warning("L3 pages now go to segment %s (was %s)", seg, store.preferred_segment or "any")
                store.prefer_segment(seg)

    # ---- prefill -> decode transfer (storage/transfer) -------------------------------------------
    def _peer(self, worker_id: str) -> ActorHandle | None:
        """A peer worker's actor: given with a call (``sender_handle``, ``notify``), else looked up once by
        its name (``actor_name``), so the ingress need not ship a handle with every request. Blocking (a
        GCS lookup the first time): threads, or ``asyncio.to_thread``."""
        handle = self.peers.get(worker_id)
        if handle is None and worker_id:
            try:
                handle = self.peers[worker_id] = ray.get_actor(actor_name(worker_id),
                                                               namespace=ray.get_runtime_context().namespace)
            except ValueError:   # not a named cluster worker (a test's bare actor) or gone
                return None
        return handle

    async def reserve(self, prompt_len: int, sender: str = "", sender_handle=None,
                      lease_id: str | None = None) -> Destination:
        """Decode side: lease the pages a prompt of ``prompt_len`` tokens will occupy; where to send.
        ``sender``: the prefill worker's id, asked before quarantined pages are freed (by its name, or
        through ``sender_handle`` when it is not a named cluster worker). ``lease_id``: the id the
        requester chose (``Reservation.new``; one of this worker's, never reused; a cancel may have come
        first, and then the reserve is refused), else a new one."""
        if not isinstance(sender, str):
            raise TypeError(f"reserve: sender is the prefill worker's id (its handle goes in sender_handle), "
                            f"got {type(sender).__name__}")
        if lease_id is None:
            lease_id = Reservation.new(self.worker_id, prompt_len).lease_id
        elif not (isinstance(lease_id, str) and lease_id.startswith(f"{self.worker_id}/") and len(lease_id) <= 128):
            raise ValueError(f"reserve: lease_id must be a str of at most 128 characters that starts with "
                             f"{self.worker_id + '/'!r}, got {lease_id!r}")
        if sender_handle is not None:
            self.peers[sender] = sender_handle
        now, ttl, one_sided = time.monotonic(), self.tcfg.lease_seconds, self.transfer.one_sided
        # Admitted like a request (a flush's hold makes it wait): a lease is the start of one.
        pages = await self.core.call_admitted(
            lambda e: False if self.core.held() else e.reserve_kv(lease_id, prompt_len, now, ttl, one_sided, sender))
        return Destination.of(pages, self.transfer, self.core.engine.cfg.page_size, ttl, self.worker_id)

    async def transfer_ended(self, lease_id: str) -> bool:
        """Decode side: the sender's send into ``lease_id`` is over; quarantined pages are freed."""
        return await self.core.call(lambda e: e.receiver.send_ended(lease_id))

    async def send_pending(self, lease_id: str) -> bool:
        """Prefill side: whether a send into ``lease_id`` may still write (if not, it never will)."""
        return self.sends.pending(lease_id, self.transfer.in_flight() if self.transfer is not None else set())

    async def cancel(self, lease_id: str) -> bool:
        """Decode side: free a lease's pages now (the prefill side failed or the client left). A cancel
        can overtake the prefill worker's reserve of the lease: that reserve is then refused (for as long
        as a lease lasts), so nobody leases pages only to wait for their expiry."""
        self.transfer.forget(lease_id)
        now, ttl = time.monotonic(), self.tcfg.lease_seconds
        return await self.core.call(lambda e: e.receiver.cancel(lease_id, now, ttl))

    @ray.method(num_returns=2)
    async def prefill_to(self, ids: list[int], params: SamplingParams, dest: Destination | Reservation,
                         notify: ActorHandle | str | None = None) -> tuple[StreamItem, Receipt | None]:
        """Prefill, then send the prompt's KV into a decode worker's leased pages: ``dest`` names them
        (leased already), or is the ``Reservation`` this worker makes itself on its decode worker while it
        computes the prompt (the ingress's way: no reserve round trip before the prefill). Returns
        (StreamItem of the first token, receipt; None when nothing was sent: the first token ended it).
        Two returns, two objects: for ray_object the receipt carries the packed payload, which Ray puts in
        the object store as this task's second return (the backend's ray.put half), and the decode worker
        reads it from there. ``notify``: the decode worker (its handle, or its id to look up by name; a
        reservation's by default), told when the send is over so quarantined pages can go back. A decode
        worker that cannot be reached raises PeerFailed naming it; one that cannot lease raises its
        MemoryError / ValueError / TransferError."""
        return await self._prefill_to(ids, params, dest, notify)

    async def _prefill_to(self, ids: list[int], params: SamplingParams, dest: Destination | Reservation,
                          notify: ActorHandle | str | None = None,
                          via: tuple[str, str] | None = None) -> tuple[StreamItem, Receipt | None]:
        """``prefill_to``; ``via``: the decode worker's channel (its endpoint and request endpoint), where
        the reservation is made (RESERVE) instead of with a Ray call."""
        reserving = isinstance(dest, Reservation)
        decode = dest.decode if reserving else dest.worker_id
        if isinstance(notify, str) or (notify is None and reserving):
            if decode not in self.peers:   # by name: its handle is looked up once
                await asyncio.to_thread(self._peer, decode)
        elif notify is not None:
            self.peers[decode] = notify
        handle = self.peers.get(decode)
        if reserving and handle is None:
            raise PeerFailed(f"decode worker {decode} not found", decode)
        self.sends.begin(dest.lease_id, decode if notify is not None or reserving else "")
        # The prompt first (its task runs first: the engine thread starts on it), then the reserve's call,
        # never cancelled: whether it leased pages is known (and the end of the send told, below) only
        # once it has answered.
        prefilling = asyncio.ensure_future(self.core.prefill(ids, params))
        leased = asyncio.ensure_future(self._reserve_on(handle, dest, via)) if reserving else None
        in_flight = False
        try:
            return await self._prefill_send(prefilling, dest, leased)
        except TransferError as e:
            in_flight = e.in_flight       # its end is reported by the backend (_send_ended)
            raise
        finally:
            if not in_flight:
                told = self.sends.end(dest.lease_id)
                if self.transfer.one_sided:
                    self._tell_ended_once_leased(told, dest.lease_id, leased)

    async def _reserve_on(self, handle: ActorHandle, res: Reservation,
                          via: tuple[str, str] | None = None) -> Destination:
        """``res`` leased on its decode worker (over its channel ``via``, else by a Ray call to ``handle``);
        its refusals as the ingress knows them."""
        if via is not None:
            return await self._reserve_over(via, res)
        try:
            return await handle.reserve.remote(res.prompt_len, self.worker_id, lease_id=res.lease_id)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause
            if isinstance(cause, (ValueError, MemoryError, TransferError)):
                raise cause from None
            raise RuntimeError(f"decode worker {res.decode}: reserve failed: {str(e).splitlines()[0]}") from None
        except ray.exceptions.RayActorError as e:
            if isinstance(e, ray.exceptions.ActorDiedError) and self.peers.get(res.decode) is handle:
                del self.peers[res.decode]   # for good: a worker of that id started later is another actor
            raise PeerFailed(f"decode worker {res.decode}: {str(e).splitlines()[0][:300]}", res.decode) from None

    async def _reserve_over(self, via: tuple[str, str], res: Reservation) -> Destination:
        """``res`` leased over the decode worker's channel: RESERVE on its request endpoint, the answer on
        this worker's DEALER to it. A decode worker that is gone (its connection dropped, no hello, no
        answer while a lease would last) is a PeerFailed naming it, as the Ray call's death would be."""
        r = Reserve(res.prompt_len, self.worker_id, res.lease_id)
        try:
            client = await self._decode_channel(via)
            return await client.reserve(r, self.tcfg.lease_seconds)
        except (ChannelLost, StaleChannel, asyncio.TimeoutError, OSError, zmq.ZMQError) as e:
            raise PeerFailed(f"decode worker {res.decode}: reserve failed: {e!r}"[:400], res.decode) from None

    async def _decode_channel(self, via: tuple[str, str]) -> ChannelClient:
        """This worker's channel to the decode worker at ``via`` (made, and its hello answered, once; one
        that failed to open or dropped since is made again, and one of a restarted worker's old endpoints
        closed: a handful of entries, one per decode worker)."""
        for k, t in list(self._decode_channels.items()):
            if t.done() and (t.cancelled() or t.exception() is not None or t.result().closed):
                if not t.cancelled() and t.exception() is None:
                    t.result().close()   # its sockets: the connection dropped, the client is ours to close
                del self._decode_channels[k]
        t = self._decode_channels.get(via)
        if t is None:
            t = self._decode_channels[via] = asyncio.ensure_future(self._open_decode_channel(via))
        return await asyncio.shield(t)

    async def _open_decode_channel(self, via: tuple[str, str]) -> ChannelClient:
        if self._zctx is None:
            self._zctx = zmq.asyncio.Context()
        client = ChannelClient(self._zctx, via[0], f"{self.worker_id}/{uuid.uuid4().hex}".encode(), via[1])
        try:
            await client.ready(min(10.0, self.tcfg.lease_seconds))
        except BaseException:
            client.close()
            raise
        return client

    def _tell_ended_once_leased(self, decode: str | None, lease_id: str, leased: asyncio.Future | None) -> None:
        """Tell ``decode`` the send into ``lease_id`` is over, after its reserve answered (told before, the
        lease made later would wait in quarantine for a probe); not at all when no lease was made."""
        if leased is None:
            self._tell_ended(decode, lease_id)
            return

        def tell(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is None:
                self._tell_ended(decode, lease_id)
        if leased.done():
            tell(leased)
        else:
            leased.add_done_callback(tell)

    async def _prefill_send(self, prefilling: asyncio.Future, dest: Destination | Reservation,
                            leased: asyncio.Future | None) -> tuple[StreamItem, Receipt | None]:
        t0 = time.monotonic()
        if leased is None:
            first, payload = await prefilling
        else:   # a reserve slower than the send's whole time leaves none to send
            (first, payload), dest = await prefill_reserving(prefilling, leased, self.tcfg.transfer_timeout,
                                                             f"decode worker {dest.decode}")
        if payload is None or first.finish_reason != "prefill":   # done at its first token: nothing to send
            return first, None
        if self.tcfg.debug_send_delay:
            await asyncio.sleep(self.tcfg.debug_send_delay)   # test-only: a stalled transfer
        budget = min(self.tcfg.transfer_timeout, dest.ttl) - (time.monotonic() - t0)
        if budget <= 0:
            raise TransferError(f"transfer to {dest.worker_id}: the lease's time was used up before sending")
        if self.transfer.one_sided:   # off the event loop: it blocks until its completion (within the budget)
            rec = await asyncio.to_thread(self.transfer.send, payload, dest, budget)
        else:   # a two-sided send only packs (the payload leaves as this task's return): no thread hop
            rec = self.transfer.send(payload, dest, budget)
        return first, rec._replace(sender=self.worker_id)

    async def decode_leased(self, ids: list[int], lease_id: str, receipt: Receipt | None, params: SamplingParams):
        """Decode side: admit the request over ``lease_id``'s pages, which the backend fills from
        ``receipt`` (engine/pd.py), and stream tokens. A one-sided send's data is in place once its
        arrival is known: waited for here, off the engine thread."""
        await self._await_arrival(lease_id, receipt)
        async for item in self.core.decode_leased(ids, lease_id, receipt, params, time.monotonic(), self.transfer):
            yield item

    async def _await_arrival(self, lease_id: str, receipt: Receipt | None) -> None:
        if receipt is not None and self.transfer.one_sided:
            try:
                await asyncio.to_thread(self.transfer.wait_arrival, lease_id, self.tcfg.transfer_timeout)
            except TransferError:
                await self.cancel(lease_id)
                raise

    async def set_transfer_options(self, **changes) -> TransferConfig:
        """Test hook: change this worker's transfer timings (lease_seconds, transfer_timeout,
        debug_send_delay, ...) at run time, validated like the YAML; the backend itself stays."""
        if "backend" in changes:
            raise ValueError("transfer backend cannot change at run time")
        self.tcfg = dataclasses.replace(self.tcfg, **changes)
        if self.transfer is not None:
            self.transfer.cfg = self.tcfg      # the backends read their timings (and test hooks) live
        return self.tcfg

    async def transfer_stats(self) -> TransferStats:
        """Leases held (decode) and the backend's counters (staging pages in use on the prefill side)."""
        leases = await self.core.call(lambda e: e.receiver.stats())
        return TransferStats(self.tcfg.backend, leases,
                             self.transfer.stats() if self.transfer is not None else SendStats())

    # ---- serving ---------------------------------------------------------------------------------
    async def generate(self, ids: list[int], params: SamplingParams) -> AsyncIterator[StreamItem]:
        """Every item as a Ray streamed object (drivers, tests, benches; the ingress uses ``submit``)."""
        async for item in self.core.generate(ids, params):
            yield item

    async def token_channel(self) -> str:
        """Where this worker's token channel is (a ZMQ address); a restarted worker has a new one."""
        return self.channel.endpoint

    async def channel_endpoints(self) -> tuple[str, str]:
        """(the token channel's address, where requests over it go): ChannelClient's two ends."""
        self._loop = asyncio.get_running_loop()   # asked before any request comes over the channel
        return self.channel.endpoint, self.channel.requests_endpoint

    def _channel_abort(self, route: Route) -> None:
        """ABORT over the channel (its reader: a colocated worker's engine thread, else its request thread): a
        request on this engine, or a handoff (its prefill, or its decode call on the decode worker)."""
        self.core.abort_routed(route)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._cancel_handoff, route)

    def _cancel_handoff(self, route: Route) -> None:
        task = self._handoffs.get(route)
        if task is not None:
            task.cancel()
        else:   # a decode half's ABORT may overtake its LEASED (two senders): refused when it comes
            self._aborted[route] = None
            while len(self._aborted) > MAX_EARLY_ABORTS:
                self._aborted.popitem(last=False)

    def _channel_handoff(self, route: Route, h: Handoff) -> None:
        """A P/D request over the channel (its request thread): run on the actor's event loop."""
        if self._loop is None:   # cannot be: the client asked channel_endpoints before sending
            self.channel.send_error(route, RuntimeError("handoff before channel_endpoints"))
            return
        self._loop.call_soon_threadsafe(self._start_handoff, route, h)

    def _start_handoff(self, route: Route, h: Handoff) -> None:
        task = self._handoffs[route] = asyncio.ensure_future(self._handoff(route, h))
        task.add_done_callback(lambda _t: self._handoffs.pop(route, None))

    async def _handoff(self, route: Route, h: Handoff) -> None:
        """A P/D request from the ingress: prefill it, reserving ``h.res`` on its decode worker (prefill_to),
        answer the first token on this channel, then hand the decode half to the decode worker over its
        request endpoint (LEASED), whose items go straight to the ingress (``h.decode_channel``,
        ``h.decode_key``); DONE here once handed on, or why it could not be (PeerFailed naming the decode
        worker). Cancelled (the client left) while prefilling: the prefill stops."""
        if not isinstance(h.params, SamplingParams) or not isinstance(h.res, Reservation):
            self.channel.send_error(route, ValueError("handoff: expected SamplingParams and a Reservation"))
            return
        try:
            first, rec = await self._prefill_to(h.ids, h.params, h.res, None,
                                                (h.decode_endpoint, h.decode_requests) if h.decode_endpoint else None)
        except asyncio.CancelledError:
            return
        except Exception as e:  # noqa: BLE001 - said to the ingress, which raises it
            self.channel.send_error(route, e)
            return
        self.channel.send_step([(route, first)])
        if rec is None or first.finish_reason != "prefill":   # done at its first token: no decode half
            return
        decode = h.res.decode
        try:
            self.leased_out.send(h.decode_requests, h.decode_channel, h.decode_key,
                                 Leased(h.ids, h.res.lease_id, rec, h.params, h.whole))
        except Exception as e:  # noqa: BLE001 - the ingress hears it rather than waits
            self.channel.send_error(route, PeerFailed(f"decode worker {decode}: cannot hand on: {e!r}", decode))
        else:
            self.channel.send_done(route)

    def _channel_reserve(self, route: Route, r: Reserve) -> None:
        """A prefill worker's RESERVE over the channel (its request thread): ``reserve`` on the event loop,
        its answer (or refusal) back to that worker's channel."""
        if self._loop is None:   # cannot be: an ingress asked channel_endpoints before naming this worker
            self.channel.send_error(route, RuntimeError("reserve before channel_endpoints"))
            return
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._reserve_reply(route, r)))

    async def _reserve_reply(self, route: Route, r: Reserve) -> None:
        try:
            dest = await self.reserve(r.prompt_len, r.sender, lease_id=r.lease_id)
        except Exception as e:  # noqa: BLE001 - the prefill worker raises it, as it would the Ray call's
            self.channel.send_error(route, e)
        else:
            self.channel.send_reserved(route, dest)

    def _channel_leased(self, route: Route, d: Leased) -> None:
        """A decode half over the channel (its request thread), from a prefill worker: on the event loop."""
        if self._loop is None:   # cannot be: the ingress asked channel_endpoints before it could send
            self.channel.send_error(route, RuntimeError("leased request before channel_endpoints"))
            return
        self._loop.call_soon_threadsafe(self._start_leased, route, d)

    def _start_leased(self, route: Route, d: Leased) -> None:
        if route in self._aborted:   # its client left before it came: free its pages now
            del self._aborted[route]
            asyncio.ensure_future(self.cancel(d.lease_id))
            return
        try:
            self.channel.route(*route)
        except StaleChannel as e:   # nobody to stream to (nor to tell): the ingress's own channel fails it
            log.warning("leased request %s refused: %s", d.lease_id, e)
            asyncio.ensure_future(self.cancel(d.lease_id))
            return
        task = self._handoffs[route] = asyncio.ensure_future(self._leased(route, d))
        task.add_done_callback(lambda _t: self._handoffs.pop(route, None))

    async def _leased(self, route: Route, d: Leased) -> None:
        """Admit a decode half (``submit_leased``'s work) and stream it to ``route``; a refusal (a lease gone,
        a bad receipt) as the route's error. Cancelled (ABORT: the client left): the request stops."""
        try:
            if not isinstance(d.params, SamplingParams) or not isinstance(d.lease_id, str):
                raise ValueError("leased request: expected SamplingParams and a lease id")
            await self._decode_to(route, d.ids, d.lease_id, d.receipt, d.params, d.whole)
        except asyncio.CancelledError:
            return
        except Exception as e:  # noqa: BLE001 - said to the ingress, which raises it
            self.channel.send_error(route, e)

    def _channel_request(self, route, ids, params, whole: bool = False) -> None:
        """A request that came over the token channel (its reader: a colocated worker's engine thread, else
        its request thread): queued to the engine thread, its items back on the channel (merged for a
        ``whole`` one), a refusal as the client's error."""
        if not isinstance(params, SamplingParams):
            self.channel.send_error(route, ValueError(f"sampling params: expected SamplingParams, "
                                                      f"got {type(params).__name__}"))
            return
        self.core.submit_routed(ids, params, route, self.channel.send_error, whole=whole)

    async def submit(self, ids: list[int], params: SamplingParams, channel: bytes, key: int,
                     whole: bool = False) -> None:
        """A request as a Ray call (drivers and benches; the ingress sends over the channel itself), its
        items over the channel. Runs one request; its items go to the ingress ``channel`` (which said hello to this worker's token
        channel, else StaleChannel) tagged ``key``, one message per step. Returns once the request is over
        (its last item is on the channel); cancelling this call aborts it."""
        route = self.channel.route(channel, key)
        async for _last in self.core.generate(ids, params, route=route, whole=whole):
            pass

    async def submit_leased(self, ids: list[int], lease_id: str, receipt: Receipt | None, params: SamplingParams,
                            channel: bytes, key: int, whole: bool = False) -> None:
        """``decode_leased`` whose items go over the token channel, as ``submit``'s do (``whole``: merged), as
        a Ray call (drivers, tests; a handoff's decode half comes over the channel: LEASED). Cancelled
        before its end, it says so on the channel: a caller that died would otherwise leave the ingress
        waiting for items that never come."""
        route = self.channel.route(channel, key)
        try:
            await self._decode_to(route, ids, lease_id, receipt, params, whole)
        except asyncio.CancelledError:
            self.channel.send_error(route, RuntimeError(f"decode worker {self.worker_id}: the request was "
                                                        f"cancelled by its caller"))
            raise

    async def _decode_to(self, route: Route, ids: list[int], lease_id: str, receipt: Receipt | None,
                         params: SamplingParams, whole: bool) -> None:
        await self._await_arrival(lease_id, receipt)
        async for _last in self.core.decode_leased(ids, lease_id, receipt, params, time.monotonic(), self.transfer,
                                                   route=route, whole=whole):
            pass

    # ---- operations ------------------------------------------------------------------------------
    async def load(self) -> WorkerLoad:
        return self.core.load()

    async def stats(self) -> dict:
        return await self.core.stats()

    async def flush_hold(self, seconds: float) -> str | None:
        """Phase one of a cluster flush (actors/ingress.py): None when idle, and then no request is
        admitted until ``flush_release`` (or ``seconds``); else why this worker cannot flush now."""
        return await self.core.hold(seconds)

    async def flush_release(self) -> None:
        self.core.release()

    async def flush_cache(self, l3: bool = False, confirm_s: float = 10.0) -> dict:
        """Flush this worker's tiers (``l3``: and this model's pages in the shared L3 store) and, once
        flushed, wait until the router has a report saying so (it then forgets this worker's pages and
        every L3 page), so a route asked after this returns predicts nothing from before. See
        AsyncEngine.flush_cache for the result; ``router_confirmed`` says whether the router has it."""
        res = await self.core.flush_cache(l3)
        if res["flushed"] and self._reporting:   # the report thread tells the router and the KV-event wire
            ack = threading.Event()
            if l3 and self.l3_events_to is not None:
                self._l3_cleared_by = ack
            self._flush_ack = ack
            confirmed = await asyncio.to_thread(ack.wait, confirm_s)
            if self.router is not None:
                res["router_confirmed"] = confirmed
        return res

    async def ping(self) -> str:
        return self.worker_id

    async def settings(self) -> tuple:
        """(EngineConfig, TransferConfig) this worker runs with: what a worker added by ``strata scale``
        is created with (the L3 connection info included)."""
        cfg = self.core.engine.cfg
        return (self.ep.engine_config(cfg) if self.ep is not None else cfg), self.tcfg

    async def drained(self) -> dict:
        """Scale-in: whether nothing runs or waits here and no lease is held; once so, the cache's
        pending write-through copies (L1->L2->L3) are finished first, so the pages outlive the worker."""
        def check(e: Engine) -> dict:
            s = e.scheduler
            busy = len(s.running) + len(s.waiting) + e.receiver.live
            if not busy:
                e.cache.poll(block=True)
            return {"busy": busy}
        return await self.core.call(check)

    async def node(self) -> str:
        """The Ray node this worker runs on (placement checks, node-loss handling)."""
        return ray.get_runtime_context().get_node_id()

    # ---- experts (EPLB) --------------------------------------------------------------------------
    async def expert_load(self) -> ExpertLoad | None:
        """The cumulative expert counters (engine/eplb.py ``ExpertLoad``), read on the engine thread between
        steps; None without slots."""
        if self.ep is not None:    # and what each rank of the group measured (actors/ep_host.py)
            return await self.ep.expert_load(self.core)
        return await self.core.call(lambda e: e.expert_reading())

    async def apply_placement(self, phy2log) -> PlacementApplied | RebalanceReport:
        """Swaps the expert weights to phy2log [L, P] between two steps: engine/eplb.py ``PlacementApplied``
        (an EP group: staged on every rank while serving, then committed on all between two steps; its
        ``RebalanceReport``)."""
        if self.ep is not None:
            return await self.ep.apply_placement(self.core, phy2log)
        return await self.core.call(lambda e: e.apply_placement(phy2log))

    async def ep_ranks(self) -> list:
        """The rank actors 1..R-1 of this worker's EP group ([] without one)."""
        return list(self.ep.peers) if self.ep is not None else []

    async def ep_placements(self) -> list:
        """phy2log [L, P] in force on each rank of the group, leader first ([] without one)."""
        return await self.ep.placements() if self.ep is not None else []

    async def check_integrity(self) -> bool:
        """Check the engine's invariants (pools, radix tree, tiers) on the engine thread; raises
        AssertionError naming the first broken one."""
        await self.core.call(lambda e: e.check_integrity())
        if self.core.integrity_failures:   # seen by the per-step checks (engine.debug_integrity)
            raise AssertionError(f"{self.worker_id}: {len(self.core.integrity_failures)} integrity failures "
                                 f"between steps, the first: {self.core.integrity_failures[0]}")
        return True

    async def process_info(self) -> dict:
        """This worker process's id and memory (anonymous RSS: what a leak grows; shared object-store
        pages are left out), for soak tests that compare it over time."""
        info = {"worker_id": self.worker_id, "pid": os.getpid()}
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "RssAnon:")):
                    key, kb = line.split()[:2]
                    info["rss_anon_bytes" if key == "RssAnon:" else "rss_bytes"] = int(kb) * 1024
        return info


def channel_host(kv_events: KVEventsConfig | None) -> str:
    """The address the token channel binds and advertises: the KV events' host where the cluster names
    one, else (``auto``) this node's IP as Ray knows it (loopback on a local cluster)."""
    if kv_events is not None and kv_events.host != "auto":
        return kv_events.host
    return ray.util.get_node_ip_address()


def resolve_hosts(engine_cfg: EngineConfig, tcfg: TransferConfig | None):
    """``auto`` addresses (transfer ``host``, Mooncake L3 ``local_hostname``) become this node's IP, so
    peers on other nodes reach this worker where it actually runs."""
    ip = None

    def node_ip() -> str:
        nonlocal ip
        ip = ip or ray.util.get_node_ip_address()
        return ip
    if tcfg is not None and tcfg.host == "auto":
        tcfg = dataclasses.replace(tcfg, host=node_ip())
    hc = engine_cfg.hicache
    mc = hc.l3.mooncake if hc is not None and hc.l3 is not None else None
    if mc is not None and mc.local_hostname == "auto":
        l3 = dataclasses.replace(hc.l3, mooncake=dataclasses.replace(mc, local_hostname=node_ip()))
        engine_cfg = dataclasses.replace(engine_cfg, hicache=dataclasses.replace(hc, l3=l3))
    return engine_cfg, tcfg


def actor_name(worker_id: str) -> str:
    """The Ray actor name of the cluster worker ``worker_id`` (in the cluster's namespace)."""
    return f"strata-{worker_id}"
