"""HTTP ingress: a Ray Serve deployment whose FastAPI app (actors/http_api.py) serves from the cluster:
the router picks a prefill worker (and a decode worker), the prefill worker has the decode worker lease
pages for the prompt's KV while it computes the prompt (actors/handoff.py), then sends the KV into them
over the configured transfer backend (storage/transfer:
Ray object store by default, NIXL or Mooncake), and tokens stream back over each worker's token channel
(actors/token_channel.py: one ZMQ message per engine step, not a Ray object per token). A request served
by one worker goes to it over that channel too (no Ray call per request), and so does a P/D request, to
its prefill worker, which hands the decode half to the decode worker itself (a Ray call worker to worker,
which carries the receipt of the KV it sent); the decode worker's items come over its own channel.

The router is asked over its route channel, Ray as the fallback, and a request whose route had no other
choice last time goes out before the router's answer: actors/route_asker.py."""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import TYPE_CHECKING, AsyncGenerator, AsyncIterator

import ray
import zmq.asyncio
from ray import serve
from ray.actor import ActorHandle

from actors.frontend import ServiceUnavailable, WorkerFailed
from actors.flush import flush_cluster
from actors.handoff import KVHandoff, PeerFailed, Reservation
from actors.http_api import build_app
from actors.route_asker import RouteAsker
from actors.route_channel import RouterError
from actors.routing import NoWorkerError, prompt_blocks
from actors.metrics import Metrics
from actors.served import Served, ServedStream
from actors.token_channel import ChannelClient, ChannelLost, Handoff, StaleChannel, request_items
from engine.stream import StreamItem
from engine.model.generation_config import sampling_defaults
from engine.model.tokenizer import TextTokenizer
from engine.sampling import SamplingParams
from storage.transfer import TransferError

if TYPE_CHECKING:
    from cluster.config import ClusterConfig

log = logging.getLogger("strata.ingress")


class RayBackend:
    def __init__(self, router: ActorHandle, workers: dict[str, ActorHandle], model_name: str, model_path: str, vocab_size: int,
                 max_context: int, request_timeout: float, settings: ClusterConfig | None = None) -> None:
        self.router, self.workers = router, workers
        self.model_name, self.vocab_size, self.max_context = model_name, vocab_size, max_context
        self.model_path = model_path
        self.tokenizer = TextTokenizer(model_path)
        self.sampling_defaults = sampling_defaults(model_path)
        self.timeout = request_timeout
        self.settings = settings
        self.router_cfg = None
        self.geometry = None
        self.kv_handoff = KVHandoff(self)
        hc = settings.engine.hicache if settings is not None else None
        self.l3_backend = hc.l3.backend if hc is not None and hc.l3 is not None else None   # cache reports
        # Token channels, one per worker, opened on first use on the event loop that serves requests.
        self._zmq: zmq.asyncio.Context | None = None
        self._channels: dict[str, ChannelClient] = {}
        self._connecting: dict[str, asyncio.Future] = {}
        self.routes = RouteAsker(router, self._zmq_context)   # the router, asked (actors/route_asker.py)

    def stream(self, ids: list[int], params: SamplingParams, avoid: tuple[str, ...] = (),
               pin: Served | None = None, whole: bool = False) -> ServedStream:
        """``pin``: the workers of an earlier request (the same prompt's other samples go where its KV
        is); a pinned worker that is gone is routed around. ``whole``: a non-streamed request (its items
        may come merged)."""
        return ServedStream(self._serve(ids, params, avoid, pin, whole))

    async def _serve(self, ids: list[int], params: SamplingParams, avoid: tuple[str, ...],
                     pin: Served | None, whole: bool = False) -> AsyncGenerator[Served | StreamItem, None]:
        """The chosen ``Served`` first, then the request's items. While the router's last answer said no
        other choice was open (``Route.alone``: one live worker of each role), a request goes there at once
        and the router is asked meanwhile (``RouteAsker.confirm``: its load estimate and prediction), so
        the route's round trip overlaps the worker's step rather than coming before it."""
        items: AsyncIterator[StreamItem] | None = None
        first: asyncio.Future | None = None   # the sole worker's first item, asked before the route's answer
        try:
            try:
                if self.router_cfg is None or self.geometry is None:
                    # Both set at once: a request that came while the first one waited here saw router_cfg
                    # set and geometry still None (a 500 in CI's multiturn test, two requests at start).
                    cfg, geometry = await self.router.config.remote(), await self.router.geometry.remote()
                    self.router_cfg, self.geometry = cfg, geometry
                sole = self.routes.sole(self.workers) if pin is None and not avoid else None
                decodes = params.max_new_tokens > 1
                if sole is not None and sole.decode is not None and decodes and self.router_cfg.local_prefill_tokens:
                    sole = None   # the router decides whether its decode worker prefills it (conditional P/D)
                if sole is not None:
                    items = self.kv_handoff.run(ids, params, sole.prefill, sole.decode, whole)
                    first = asyncio.ensure_future(_first_item(items))
                    await asyncio.sleep(0)   # let it send the request before the route is asked
                # hashed here: ingress replicas scale, the router doesn't
                keys = prompt_blocks(ids, self.geometry, self.router_cfg)
                if sole is not None:
                    r = await self.routes.confirm(keys, len(ids))
                    if r is None:
                        served = Served(sole.prefill, sole.decode)   # not predicted: the router did not answer
                    else:
                        served = Served(r.prefill, r.decode, r.cached_pages * self.geometry.page_size)
                        if (r.prefill, r.decode) != (sole.prefill, sole.decode):   # drained, or one added
                            await _withdraw(first, items)
                            first = items = None
                elif pin is not None and pin.prefill in self.workers and pin.decode in (None, *self.workers) \
                        and not {pin.prefill, pin.decode} & set(avoid):
                    served = Served(pin.prefill, pin.decode)   # not predicted: the router was not asked
                else:
                    r = await self.routes.route(keys, len(ids), avoid, local=decodes)
                    served = Served(r.prefill, r.decode, r.cached_pages * self.geometry.page_size)
                for w in (served.prefill, served.decode):
                    if w is not None and w not in self.workers:   # scaled out since this replica started
                        self.workers[w] = await asyncio.get_running_loop().run_in_executor(None, self._lookup, w)
            except (ray.exceptions.RayError, NoWorkerError, RouterError) as e:
                raise ServiceUnavailable(f"no route: {str(e).splitlines()[-1][:200]}") from None
            for w in {served.prefill, served.decode} & set(avoid):
                await self._wait_alive(w)  # the only such worker failed this request: let it restart first
            yield served
            try:
                if items is None:
                    items = self.kv_handoff.run(ids, params, served.prefill, served.decode, whole)
                elif (item := await first) is not None:
                    yield item
                async for item in items:
                    yield item
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as e:
                raise WorkerFailed(str(e).splitlines()[0][:300],
                                   tuple(w for w in (served.prefill, served.decode) if w)) from None
        finally:
            await _withdraw(first, items)   # the worker's part stops now, not when the generator is collected

    def _lookup(self, worker: str) -> ActorHandle:
        """The handle of a worker this replica has not seen (added by ``strata scale``), by its name."""
        ns = self.settings.ray.namespace if self.settings is not None else "strata"
        return ray.get_actor(f"strata-{worker}", namespace=ns)

    async def _wait_alive(self, worker: str, timeout: float = 60.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                await asyncio.wait_for(self.workers[worker].ping.remote(), 5)
                return
            except (ray.exceptions.RayError, asyncio.TimeoutError):
                if asyncio.get_running_loop().time() > deadline:
                    raise ServiceUnavailable(f"worker {worker} did not come back in {timeout:.0f}s") from None
                await asyncio.sleep(0.5)

    # ---- the handoff's Workers protocol (actors/handoff.py): over the token channels, bounded, errors mapped
    async def handoff(self, prefill: str, ids: list[int], params: SamplingParams, res: Reservation,
                      whole: bool = False) -> AsyncIterator[StreamItem]:
        """One P/D request, with no Ray call on its way: HANDOFF over the prefill worker's token channel,
        which reserves the lease on ``res.decode`` (RESERVE, over the decode worker's channel), answers the
        first token there and hands the decode half to ``res.decode`` itself (LEASED, over the decode
        worker's request endpoint); that half's items, or its refusal, come over this replica's
        channel to the decode worker (opened first: the decode worker sends only to a channel that said
        hello, StaleChannel otherwise). The prefill worker says DONE once it has handed the request on, or
        why it could not (relayed into the decode half's queue). Closing this early aborts it all (ABORT to
        both workers). A worker whose channel drops is WorkerFailed (retried), but the prefill worker's
        after the first token: the decode half goes on without it."""
        dclient = await self._channel(res.decode)
        pclient = await self._channel(prefill)
        pkey, pq = pclient.open()
        dkey, dq = dclient.open()
        relay: asyncio.Future | None = None
        finished, worker, client = False, prefill, pclient
        try:
            pclient.handoff(pkey, Handoff(ids, params, whole, res, dclient.identity, dkey, dclient.requests_endpoint,
                                          dclient.endpoint))
            try:
                first = await anext(request_items(pq, self.timeout, CHANNEL_GRACE_S))
            except asyncio.TimeoutError:
                raise ServiceUnavailable(f"prefill on {prefill} with kv transfer to {res.decode} timed out") from None
            finished = first.finish_reason != "prefill"   # done at its first token: no decode half
            yield first
            if finished:
                return
            relay = asyncio.ensure_future(_relay(pq, dq))
            worker, client = res.decode, dclient
            async for item in request_items(dq, self.timeout, CHANNEL_GRACE_S):
                finished = item.finished
                yield item
        except (ChannelLost, StaleChannel) as e:   # the worker's channel is not to be trusted: reopened
            self._drop_channel(worker, client)
            raise WorkerFailed(f"worker {worker}'s token channel: {e}", (worker,)) from None
        except PeerFailed as e:
            raise WorkerFailed(str(e), (e.worker,)) from None
        except TransferError as e:
            raise ServiceUnavailable(f"kv transfer failed: {e}") from None
        finally:
            if relay is not None:
                relay.cancel()
            pclient.release(pkey)
            dclient.release(dkey)
            if not finished:   # the client left, a timeout, a failure: nothing goes on computing for nobody
                pclient.abort(pkey)
                dclient.abort(dkey)

    def cancel(self, decode: str, lease_id: str) -> None:
        self.workers[decode].cancel.remote(lease_id)

    async def generate(self, worker: str, ids: list[int], params: SamplingParams,
                       whole: bool = False) -> AsyncIterator[StreamItem]:
        """One request on ``worker``, sent over its token channel (no Ray call: ChannelClient.submit); its
        items come back there. A worker that dies (the channel's connection drops) is WorkerFailed, which
        the caller retries; closing this early aborts the request on the worker."""
        client = await self._channel(worker)
        key, q = client.open()
        finished = False
        try:
            client.submit(key, ids, params, whole)
            async for item in request_items(q, self.timeout, CHANNEL_GRACE_S):
                finished = item.finished
                yield item
        except ChannelLost as e:
            self._drop_channel(worker, client)
            raise WorkerFailed(f"worker {worker}'s token channel: {e}", (worker,)) from None
        finally:
            client.release(key)
            if not finished:   # the client left, a timeout
                client.abort(key)

    # ---- the token channel (actors/token_channel.py) --------------------------------------------------
    async def _channel(self, worker: str) -> ChannelClient:
        c = self._channels.get(worker)
        if c is not None and not c.closed:
            if c.loop is asyncio.get_running_loop():
                return c
            self._drop_channel(worker, c)   # opened on another event loop (one that has ended): its reader is gone
        pending = self._connecting.get(worker)
        if pending is None:   # one connection per worker, however many requests wait for it
            pending = self._connecting[worker] = asyncio.ensure_future(self._connect(worker))
            pending.add_done_callback(lambda _f: self._connecting.pop(worker, None))
        return await asyncio.shield(pending)

    def _zmq_context(self) -> zmq.asyncio.Context:
        """The replica's one ZMQ context (one IO thread), for its token channels and its route channel."""
        if self._zmq is None:
            self._zmq = zmq.asyncio.Context()
        return self._zmq

    async def _connect(self, worker: str) -> ChannelClient:
        endpoint, requests = await asyncio.wait_for(self.workers[worker].channel_endpoints.remote(), self.timeout)
        c = ChannelClient(self._zmq_context(), endpoint, uuid.uuid4().bytes, requests)
        try:
            await c.ready(CHANNEL_CONNECT_S)
        except asyncio.TimeoutError:
            c.close()
            raise WorkerFailed(f"worker {worker}'s token channel at {endpoint} did not answer", (worker,)) from None
        self._drop_channel(worker)
        self._channels[worker] = c
        return c

    def close_channels(self) -> None:
        """Close every channel of this replica, the token channels and the route channel (their sockets,
        then their ZMQ context)."""
        for w in list(self._channels):
            self._drop_channel(w)
        self.routes.drop()
        if self._zmq is not None:
            self._zmq.destroy(linger=0)
            self._zmq = None

    def _drop_channel(self, worker: str, client: ChannelClient | None = None) -> None:
        """Close ``worker``'s channel (only if it is still ``client``, when given)."""
        c = self._channels.get(worker)
        if c is not None and (client is None or c is client):
            del self._channels[worker]
            c.close()

    async def server_info(self) -> dict:
        """The settings SGLang's tooling reads from /get_server_info, under SGLang's names."""
        info = {"model_path": self.model_path, "tokenizer_path": self.model_path,
                "served_model_name": self.model_name, "context_length": self.max_context,
                "page_size": 0, "enable_hierarchical_cache": False}
        cfg = self.settings
        if cfg is None:
            return info
        e, hc = cfg.engine, cfg.engine.hicache
        l3 = hc.l3 if hc is not None else None
        info.update(page_size=e.page_size, max_total_num_tokens=e.num_pages * e.page_size,
                    chunked_prefill_size=e.chunk_size or e.max_batch_tokens, max_prefill_tokens=e.max_batch_tokens,
                    max_running_requests=e.max_running_requests, swa_full_tokens_ratio=e.swa_full_ratio,
                    disable_radix_cache=not e.enable_prefix_cache, dtype=e.dtype, random_seed=e.seed,
                    enable_hierarchical_cache=hc is not None,
                    hicache_size=(hc.host_pages * e.page_size) if hc is not None else 0,
                    hicache_write_policy=hc.write_policy if hc is not None else None,
                    hicache_mem_layout=hc.layout if hc is not None else None,
                    hicache_storage_backend=l3.backend if l3 is not None else None,
                    hicache_storage_prefetch_policy=l3.prefetch_policy if l3 is not None else None,
                    disaggregation_mode="pd" if cfg.workers.decode else "null",
                    prefill_workers=cfg.workers.prefill, decode_workers=cfg.workers.decode,
                    host=cfg.server.host, port=cfg.server.port)
        return info

    async def health(self) -> dict:
        try:
            st = await asyncio.wait_for(self.router.status.remote(), 5)
        except Exception as e:
            return {"ok": False, "error": repr(e)}
        live = [w for w, s in st["workers"].items() if s["age_s"] < 3]
        return {"ok": bool(live), "workers": live, "indexed_pages": st["indexed_pages"]}

    async def _sync_workers(self) -> dict:
        """The workers the router knows now (scale out adds, scale in removes): handles by name."""
        try:
            st = await asyncio.wait_for(self.router.status.remote(), 5)
        except Exception:   # noqa: BLE001 - keep the set we have
            return self.workers
        known = set(st["workers"])
        for w in [w for w in self.workers if w not in known]:
            del self.workers[w]
            self._drop_channel(w)
        for w in known - set(self.workers):
            try:
                self.workers[w] = await asyncio.get_running_loop().run_in_executor(None, self._lookup, w)
            except ValueError:   # gone meanwhile
                pass
        return self.workers

    async def flush_cache(self, hold_s: float = 60.0) -> dict:
        """Flush every worker or none (actors/flush.py has the steps and the answer's shape)."""
        await self._sync_workers()
        return await flush_cluster(self, dict(self.workers), self.settings, hold_s)

    # ---- flush_cluster's Workers protocol (actors/flush.py) ----
    async def hold(self, handle, seconds: float) -> str | None:
        return await handle.flush_hold.remote(seconds)

    async def release(self, handle) -> None:
        await handle.flush_release.remote()

    async def flush_one(self, handle, l3: bool) -> dict:
        return await handle.flush_cache.remote(l3)

    async def gauges(self) -> dict:
        out = {}
        try:
            st = await asyncio.wait_for(self.router.status.remote(), 2)
        except Exception:
            return out
        out["strata_router_indexed_pages"] = st["indexed_pages"]
        out["strata_router_decisions_total"] = st["decisions"]
        for w, s in st["workers"].items():
            load = s["load"]
            lab = f'{{worker="{w}",role="{s["role"]}"}}'
            out[f"strata_worker_running|{lab}"] = load.get("running", 0)
            out[f"strata_worker_queued_tokens|{lab}"] = load.get("queued_tokens", 0)
            out[f"strata_kv_pages_free|{lab}"] = load.get("free_pages", 0)
            out[f"strata_kv_pages_total|{lab}"] = load.get("total_pages", 0)
            if "host_kv_bytes" in load:
                out[f"strata_host_kv_bytes|{lab}"] = load["host_kv_bytes"]
                for d, n in load.get("kv_moved_bytes", {}).items():
                    out[f'strata_kv_moved_bytes|{lab[:-1]},direction="{d}"}}'] = n
                lb = load.get("kv_loadback_pages", {})   # L2 -> L1 pages: loaded, read, released unread, waited
                for kind in ("loaded", "used", "wasted", "deferred"):
                    out[f'strata_kv_loadback_pages|{lab[:-1]},kind="{kind}"}}'] = lb.get(kind, 0)
        out.update(await self._eplb_gauges())
        await self._sync_workers()
        res = await asyncio.gather(*(asyncio.wait_for(h.transfer_stats.remote(), 2) for h in self.workers.values()),
                                   return_exceptions=True)
        for w, t in zip(self.workers, res):
            if isinstance(t, BaseException):
                continue
            lab, bs = f'{{worker="{w}",backend="{t.backend}"}}', t.sends
            out[f"strata_transfer_bytes_total|{lab}"] = bs.bytes
            out[f"strata_transfer_sends_total|{lab}"] = bs.sends
            out[f"strata_transfer_failures_total|{lab}"] = bs.failed + bs.timeouts
            out[f"strata_transfer_leases_live|{lab}"] = t.leases.live
            out[f"strata_transfer_leases_expired_total|{lab}"] = t.leases.expired
        return out

    async def _eplb_gauges(self) -> dict:
        """The EPLB rebalancer's status, when one runs (found by name, looked up at most every 10 s)."""
        loop = asyncio.get_running_loop()
        eplb = getattr(self, "_eplb", None)
        if eplb is None and loop.time() >= getattr(self, "_eplb_next_lookup", 0.0):
            self._eplb_next_lookup = loop.time() + 10.0
            eplb = self._eplb = await loop.run_in_executor(None, _find_eplb)
        if eplb is None:
            return {}
        try:
            st = await asyncio.wait_for(eplb.status.remote(), 2)
        except Exception:
            self._eplb = None
            return {}
        return eplb_gauges(st)


def _find_eplb():
    from actors.eplb_actor import ACTOR_NAME
    try:
        for a in ray.util.list_named_actors(all_namespaces=True):
            if a["name"] == ACTOR_NAME:
                return ray.get_actor(ACTOR_NAME, namespace=a["namespace"])
    except Exception:
        pass
    return None


def eplb_gauges(st: dict) -> dict:
    """Prometheus gauges from EplbRebalancerActor.status()."""
    out = {"strata_eplb_rebalances_total": st["rebalances"], "strata_eplb_skipped_total": st["skipped"],
           "strata_eplb_rebalance_seconds": st["last_seconds"],
           "strata_eplb_apply_seconds": st["last_apply_seconds"],
           "strata_eplb_rebalance_seconds_total": st["total_seconds"],
           "strata_eplb_balancedness_mean": st["balancedness_mean"]}
    for i, b in enumerate(st["balancedness"]):
        out[f'strata_eplb_balancedness|{{layer="{i}"}}'] = b
    for i, b in enumerate(st["measured_balancedness"]):
        out[f'strata_eplb_measured_balancedness|{{layer="{i}"}}'] = b
    for r, n in enumerate(st["rank_load_total"]):
        out[f'strata_eplb_rank_load|{{rank="{r}"}}'] = n
    # Expert-parallel groups (actors/ep_group.py): what each rank measured in the last interval and its
    # cumulative expert compute time.
    for r, n in enumerate(torch_sum_rows(st.get("rank_load_last", []))):
        out[f'strata_ep_rank_tokens_last|{{rank="{r}"}}'] = n
    for w, secs in st.get("rank_moe_seconds", {}).items():
        for r, v in enumerate(secs):
            out[f'strata_ep_rank_moe_seconds_total|{{worker="{w}",rank="{r}"}}'] = v
    last = st.get("last_applied") or {}
    if "planned_moves" in last:
        out["strata_eplb_last_moved_slots"] = last["planned_moves"]
        out["strata_eplb_last_reference_moves"] = last["reference_moves"]
    return out


def torch_sum_rows(rows: list) -> list:
    """[L][R] nested lists -> per-rank sums [R] (layers summed)."""
    return [sum(col) for col in zip(*rows)] if rows else []


# How long the last item may lag the call that says the request is over (a channel that lost it is a
# failed worker: retried like one), and how long a new channel may take to answer its hello.
CHANNEL_GRACE_S = 10.0
CHANNEL_CONNECT_S = 10.0


async def _withdraw(first: asyncio.Future | None, items: AsyncIterator[StreamItem] | None) -> None:
    """Stop a request's items: the task reading its first one (cancelled if still waiting: the request is
    aborted on its worker) and the stream itself (closed)."""
    if first is not None:
        if not first.done():
            first.cancel()
            await asyncio.wait((first,))
        if not first.cancelled():
            first.exception()   # seen: the error of a request nobody reads any more is no news
    if items is not None:
        await items.aclose()


async def _first_item(items: AsyncIterator[StreamItem]) -> StreamItem | None:
    """The first of ``items`` (None: there was none), as a task: a request sent before its route's answer."""
    try:
        return await anext(items)
    except StopAsyncIteration:
        return None


async def _relay(pq: asyncio.Queue, dq: asyncio.Queue) -> None:
    """Why a prefill worker could not hand its request on into the decode half's queue. Its DONE (handed
    on) and its channel lost meanwhile say nothing about the decode half, which goes on (its own channel's
    loss, its refusal there, and the per-item timeout still end it)."""
    x = await pq.get()
    if isinstance(x, BaseException) and not isinstance(x, ChannelLost):
        dq.put_nowait(x)


def _unwrap(e: Exception) -> Exception:
    """Ray wraps a worker's ValueError/MemoryError; give the HTTP layer the original kind. A failed KV
    transfer is a 503 with its reason; a peer the worker could not reach (the decode worker a prefill
    worker reserves on) failed as if this replica had called it: retried away from it."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, PeerFailed):
        return WorkerFailed(str(cause), (cause.worker,))
    if isinstance(cause, TransferError):
        return ServiceUnavailable(f"kv transfer failed: {cause}")
    return cause if isinstance(cause, (ValueError, MemoryError)) else RuntimeError(str(e).splitlines()[0])


@serve.ingress()
class Ingress:
    def __init__(self, router: ActorHandle, workers: dict[str, ActorHandle], model_name: str, model_path: str,
                 vocab_size: int, max_context: int, request_timeout: float = 120.0, max_inflight: int = 256,
                 settings: ClusterConfig | None = None) -> None:
        self.backend = RayBackend(router, workers, model_name, model_path, vocab_size, max_context,
                                  request_timeout, settings)
        self.max_inflight = max_inflight

    def __serve_build_asgi_app__(self):
        app = build_app(self.backend, Metrics(), self.max_inflight)
        self.frontend = app.state.frontend
        return app

    # Called by launch through a DeploymentHandle (cluster/lifecycle.py), not over HTTP.
    async def phase(self) -> str:
        return "draining" if self.frontend.draining else "ready"

    async def drain(self) -> int:
        """Take no new request (503 "shutting down", /health 503 draining); returns how many are in flight."""
        self.frontend.draining = True
        return self.frontend.inflight

    async def inflight(self) -> int:
        return self.frontend.inflight

    def __del__(self) -> None:
        # Serve calls this as the replica shuts down: its channels' sockets close now, with the replica.
        backend = getattr(self, "backend", None)
        if backend is not None:
            try:
                backend.close_channels()
            except Exception:  # noqa: BLE001 - shutting down: nothing is left to tell
                pass
