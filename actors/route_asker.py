"""An ingress replica's side of the router: how it asks ``route``, and what it keeps of the answers.

The router is asked over its route channel (actors/route_channel.py: one ZMQ round trip, ~0.08 ms, where
a Ray actor call costs ~1 ms and CPU on both sides), one per replica, opened on first use from the
endpoint the router names (``route_endpoint``, a Ray call). The Ray call ``route`` stays the fallback: a
request whose answer does not come over the channel (no endpoint, a timeout, the router's connection lost:
it restarted) is asked over Ray, and the channel is dropped, to be reopened from the endpoint the router
names next (a restarted router binds anew). Both doors reach the same ``route`` in the one router actor.

The sole choice: while the router's last answer was the only choice it had (``Route.alone``: one live
worker of each role, a colocated or a 1P+1D cluster), the ingress sends a request to those workers at once
and asks the router meanwhile (``confirm``, over the channel only): the round trip (~1 ms with the
prompt's hashing, between processes woken from idle) overlaps the worker's step instead of coming before
it, and the router still counts the request and predicts its hit. An answer that names other workers (an
operator drained one, one was added) withdraws the request (aborted there, before any of its items is
passed on) and sends it where the router says; no answer (no channel, the router restarting) leaves it
where it went, unpredicted. Either ends the shortcut: the next requests ask first. With conditional
disaggregation on (``RouterConfig.local_prefill_tokens``), a P/D request with a decode phase always asks
first: whether its decode worker prefills it depends on the prompt (``Router.route``'s ``local``).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Mapping

import ray
import zmq.asyncio
from ray.actor import ActorHandle

from actors.prefix_router import Route
from actors.route_channel import ChannelDown, RouteClient, RouterError
from actors.routing import NoWorkerError
from actors.served import Served

log = logging.getLogger("strata.ingress")

# The route channel: how long an answer (or the router's endpoint) may take before the request goes over
# Ray, and how long routes go over Ray after the endpoint could not be had.
ROUTE_CHANNEL_TIMEOUT_S = 2.0
ROUTE_CHANNEL_RETRY_S = 1.0
# How long a route that was the only choice is taken as the next requests' (each answer renews it).
SOLE_ROUTE_TTL_S = 1.0


class RouteAsker:
    """``router``: the router actor's handle; ``zmq_context``: the replica's ZMQ context (made on first use).
    Serves the replica's event loop (a channel opened on a loop that has ended is opened anew)."""

    def __init__(self, router: ActorHandle, zmq_context: Callable[[], zmq.asyncio.Context]) -> None:
        self.router, self._zmq_context = router, zmq_context
        # ``_retry_at``: the loop time before which routes go over Ray without asking for an endpoint (the
        # last ask failed).
        self._chan: RouteClient | None = None
        self._connecting: asyncio.Future | None = None
        self._retry_at = 0.0
        # The router's last answer when it was the only choice, and the loop time it is trusted until.
        self._sole: tuple[Served, float] | None = None

    # ---- the sole choice -------------------------------------------------------------------------------
    def sole(self, known: Mapping[str, object]) -> Served | None:
        """The workers the router's last answer said were the only choice, while that answer is recent
        (``SOLE_ROUTE_TTL_S``) and ``known`` (the replica's workers) still holds them; else None (ask the
        router first)."""
        if self._sole is None:
            return None
        sole, until = self._sole
        if asyncio.get_running_loop().time() > until or sole.prefill not in known \
                or (sole.decode is not None and sole.decode not in known):
            self._sole = None
            return None
        return sole

    def _learn(self, r: Route) -> None:
        """Keep (or forget) the router's answer as the next requests' choice, by whether it was the only one.
        An answer that has the sole pair's decode worker prefill the prompt itself (conditional
        disaggregation: never ``alone``, it depends on the prompt) says nothing of the pair: kept as it is."""
        if not r.alone and r.decode is None and self._sole is not None and self._sole[0].decode == r.prefill:
            return
        self._sole = (Served(r.prefill, r.decode), asyncio.get_running_loop().time() + SOLE_ROUTE_TTL_S) \
            if r.alone else None

    async def confirm(self, keys: list[int], n: int) -> Route | None:
        """The router's route of a request already sent to the sole choice (over the channel only: the
        request does not wait on Ray for a choice it has made), which keeps or forgets that choice; None
        when no answer came (the request stays where it went, unpredicted, and the next requests ask
        first). The caller withdraws the request when the answer names other workers (one drained, or
        added)."""
        client = await self.client()
        try:
            if client is None:
                raise ChannelDown("no route channel")
            r = await client.route(keys, n, [], local=False)   # it went to the pair already
        except (ChannelDown, NoWorkerError, RouterError) as e:
            log.info("a request sent to the sole choice is unconfirmed: %s", e)
            if isinstance(e, ChannelDown) and client is not None:
                self.drop(client)
            self._sole = None
            return None
        self._learn(r)
        return r

    # ---- asking ------------------------------------------------------------------------------------------
    async def route(self, keys: list[int], n: int, avoid: tuple[str, ...], wait: float = 10.0,
                    local: bool = True) -> Route:
        """Ask the router (over its route channel, else over Ray), and learn from its answer whether it was
        the only choice (``local``: Router.route's, whether the request has a decode phase); a router
        that has just restarted knows no worker until their next reports (every report interval), so "no
        prefill/decode worker" is retried for a few seconds rather than failing."""
        deadline = asyncio.get_running_loop().time() + wait
        while True:
            try:
                r = await self._once(keys, n, list(avoid), local)
                self._learn(r)
                return r
            except NoWorkerError:
                if asyncio.get_running_loop().time() > deadline:
                    raise
            except ray.exceptions.RayTaskError as e:
                if not isinstance(e.cause, NoWorkerError) or asyncio.get_running_loop().time() > deadline:
                    raise
            await asyncio.sleep(0.1)

    async def _once(self, keys: list[int], n: int, avoid: list[str], local: bool = True) -> Route:
        """One ask: over the channel, or over Ray when the channel cannot answer (then dropped: the next
        request asks the router where it listens now). A request whose answer timed out may be counted
        twice in the router's load: an estimate anyway, until the worker's next report."""
        client = await self.client()
        if client is not None:
            try:
                return await client.route(keys, n, avoid, local)
            except ChannelDown as e:
                log.info("routing over Ray: %s", e)
                self.drop(client)
        return await self.router.route.remote(keys, n, avoid, local)

    # ---- the channel -------------------------------------------------------------------------------------
    async def client(self) -> RouteClient | None:
        """The replica's route channel, opened if need be (one opening, however many requests wait);
        None when there is none to use now (the request goes over Ray)."""
        loop = asyncio.get_running_loop()
        c = self._chan
        if c is not None:
            if not c.closed and c.loop is loop:
                return c
            self.drop(c)   # lost, or opened on another event loop (one that has ended)
        if loop.time() < self._retry_at:
            return None
        pending = self._connecting
        if pending is None or pending.get_loop() is not loop:
            pending = self._connecting = asyncio.ensure_future(self._connect())
        try:
            return await asyncio.shield(pending)
        except Exception as e:  # noqa: BLE001 - Ray serves this request; the next ones after the pause
            log.info("no route channel (routing over Ray for %gs): %r", ROUTE_CHANNEL_RETRY_S, e)
            return None

    async def _connect(self) -> RouteClient | None:
        loop = asyncio.get_running_loop()
        try:
            endpoint = await asyncio.wait_for(self.router.route_endpoint.remote(), ROUTE_CHANNEL_TIMEOUT_S)
            if endpoint is None:   # the router could not bind one
                self._retry_at = loop.time() + ROUTE_CHANNEL_RETRY_S
                return None
            self.drop()
            self._chan = RouteClient(self._zmq_context(), endpoint, ROUTE_CHANNEL_TIMEOUT_S)
            return self._chan
        except BaseException:
            self._retry_at = loop.time() + ROUTE_CHANNEL_RETRY_S
            raise
        finally:
            if self._connecting is asyncio.current_task():
                self._connecting = None

    def drop(self, client: RouteClient | None = None) -> None:
        """Close the route channel (only if it is still ``client``, when given)."""
        c = self._chan
        if c is not None and (client is None or c is client):
            self._chan = None
            c.close()
