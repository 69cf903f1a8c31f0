"""An Engine driven by its own thread, with an asyncio API: what a worker process serves from.

The engine (and the radix tree inside it) is only ever touched by the engine thread; callers on any
event loop submit commands and read per-request streams. Nothing here knows about Ray.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import queue
import select
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol

from engine.engine import Engine
from engine.request import Status
from engine.sampling import SamplingParams
from engine.stream import PrefillResult, StreamItem, merge_items
from engine.worker_load import WorkerLoad
from storage.transfer.base import Receipt, TransferBackend
from storage.transfer.payload import KVPayload

log = logging.getLogger("strata.engine")


WHOLE_SEND_TOKENS, WHOLE_SEND_SECONDS = 50, 1.0
"""A whole (non-streamed) request's items are held on the engine thread and sent as one: when it ends, or
once this many tokens are held, or its first held token is this old (so a long or slow answer still shows
progress to the ingress's per-item timeout). SGLang's scheduler sends a non-streamed request's output at
its end and every 50 tokens (its force-stream interval)."""


def _settle(fut: asyncio.Future, res: Any, exc: BaseException | None) -> None:
    """``AsyncEngine.call``'s answer, on the caller's loop: a caller that was cancelled meanwhile (its client
    left) reads nothing, and setting its future would only log an InvalidStateError."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(res)


@dataclass
class _Sink:
    """Where the engine thread puts one request's items, for a reader on ``loop``. With a ``route``, the
    items go to ``AsyncEngine.on_step`` instead, batched per step, and only the last one to ``items`` too
    (after its step's batch is handed on), so that the reader knows the request is over."""
    loop: asyncio.AbstractEventLoop
    items: asyncio.Queue
    payload: KVPayload | None = None   # a prefill-only request's export, set before its last item is put
    route: Any = None
    # A whole request (routed only): its items are held here and sent as one (WHOLE_SEND_TOKENS); ``held_at``
    # is when the first held token was made (time.monotonic()).
    whole: bool = False
    held: StreamItem | None = None
    held_at: float = 0.0


class Inbox(Protocol):
    """Requests the engine thread reads itself (a worker's token channel, actors/token_channel.py): one
    thread woken per request, not a reader thread and then the engine thread."""

    fd: int   # readable (edge-triggered, as a ZMQ socket's) when requests may be waiting

    def take(self) -> None:
        """Handle every request waiting, without blocking (on the engine thread)."""

    def close(self) -> None:
        """Close it (on the engine thread, once it is no longer read)."""


class AsyncEngine:
    def __init__(self, engine: Engine, name: str = "engine") -> None:
        self.engine = engine
        self._cmds: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        # An inbox (set_inbox) is polled beside the commands while the engine is idle: a command wakes that
        # poll through this pipe, written only while the engine thread sleeps in it.
        self._inbox: Inbox | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poll = select.poll()
        self._poll.register(self._wake_r, select.POLLIN)
        # The inbox's fd alone, looked at between steps: its signal is what makes a take worth its cost
        # (ZMQ's EVENTS query, ~30 us after a step here, against ~8 for a poll of the fd).
        self._inbox_poll = select.poll()
        self._sleeping = False
        self._streams: dict[str, _Sink] = {}
        self._ids = itertools.count()
        self._stop = False
        self.last_step_time = time.monotonic()
        self.steps = 0
        # EngineConfig.debug_integrity: check every invariant after each step and command (the reliability
        # suite runs so): a page owned twice for a moment, gone again by the next flush, is caught here.
        self.debug_integrity = engine.cfg.debug_integrity
        self.integrity_failures: list[str] = []
        # A flush's first phase holds admissions (monotonic deadline; 0: open) so that the engine stays idle
        # until every worker of the cluster has flushed (actors/ingress.py); it lapses by itself if the
        # flush never comes (its caller died).
        self._held_until = 0.0
        # Routed requests' items of the step in progress, handed to ``on_step`` once it is over: the caller's
        # channel sends a step's items together (one message, not one per token). Set before any routed
        # request; called on the engine thread, so it must not block.
        self.on_step: Callable[[list[tuple[Any, StreamItem]]], None] | None = None
        self._routed: list[tuple[Any, StreamItem]] = []
        self._routed_last: list[tuple[_Sink, StreamItem]] = []
        # Requests admitted by ``submit_routed`` (no event loop: a token channel's), by their route, and
        # those a flush's hold keeps out for now (admitted when it ends).
        self._by_route: dict[Any, str] = {}
        self._deferred: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._run, name=f"strata-{name}", daemon=True)
        self._thread.start()

    # ---- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            busy = self.engine.has_unfinished()
            cache = self.engine.cache
            copying = cache.copier.num_pending > 0 or cache.prefetching()   # an aborted request's L3 read
            if self._inbox is not None and self._inbox_poll.poll(0):
                self._take_inbox()
            try:
                if busy:
                    cmd = self._cmds.get_nowait()
                else:  # idle: still apply finished background copies (L2 backups, L3 writes) promptly
                    cmd = self._wait(0.01 if copying or self._deferred else None)
            except queue.Empty:
                cmd = None
            polled = copying and not busy
            if polled:
                cache.poll()
            if self._deferred and not self.held():
                deferred, self._deferred = self._deferred, []
                for add in deferred:
                    add()
            if cmd is not None:
                cmd()
                while True:  # drain the rest before stepping
                    try:
                        self._cmds.get_nowait()()
                    except queue.Empty:
                        break
            if self.debug_integrity and (cmd is not None or polled):
                self._check(f"after a command or finished copies, step {self.steps}")
            if self.engine.has_unfinished():
                try:
                    outs = self.engine.step()
                except Exception as e:  # a broken step must not leave clients hanging
                    self._fail_all(f"engine step failed: {e!r}")
                    continue
                self.steps += 1
                self.last_step_time = time.monotonic()
                for o in outs:
                    self._emit(o.rid, o.new_token_ids, o.finished, o)
                if self.debug_integrity:
                    self._check(f"after step {self.steps}")
            if self._routed or self._routed_last:   # a step's items, or a request finished by a command
                self._flush_routed()

    def _wait(self, timeout: float | None) -> Callable[[], None]:
        """The next command, waiting up to ``timeout`` s (None: for ever) for one, or for the inbox's
        requests (which queue theirs); queue.Empty if none came."""
        if self._inbox is None:
            return self._cmds.get(timeout=timeout)
        self._sleeping = True   # from here on a command's sender writes the wake pipe (_command)
        try:
            try:
                return self._cmds.get_nowait()
            except queue.Empty:
                pass
            self._poll.poll(None if timeout is None else timeout * 1000)
        finally:
            self._sleeping = False
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:   # woken by the inbox, not by a command
            pass
        if self._inbox is not None:
            self._take_inbox()
        return self._cmds.get_nowait()

    def _take_inbox(self) -> None:
        try:
            self._inbox.take()
        except Exception as e:  # noqa: BLE001 - a broken inbox must not stop the engine: it is dropped
            log.exception("the engine's inbox failed; it is no longer read")
            self._detach(self._inbox, e)

    def _detach(self, inbox: Inbox, why: BaseException | None = None) -> None:
        if self._inbox is inbox:
            self._inbox = None
            self._poll.unregister(inbox.fd)
            self._inbox_poll.unregister(inbox.fd)
        try:
            inbox.close()
        except Exception:  # noqa: BLE001
            if why is None:
                raise

    def set_inbox(self, inbox: Inbox) -> None:
        """Read ``inbox`` on the engine thread from now on (until ``detach_inbox``)."""
        def attach() -> None:
            self._inbox = inbox
            self._poll.register(inbox.fd, select.POLLIN)
            self._inbox_poll.register(inbox.fd, select.POLLIN)
            self._take_inbox()   # what came before: its signal may be spent already
        self._command(attach)

    def detach_inbox(self, inbox: Inbox, timeout: float = 2.0) -> None:
        """Stop reading ``inbox`` and close it on the engine thread; closed here if that thread does not
        answer within ``timeout`` (it is gone or stuck: it reads nothing then)."""
        done = threading.Event()

        def detach() -> None:
            try:
                self._detach(inbox)
            finally:
                done.set()
        self._command(detach)
        if not done.wait(timeout) and self._inbox is inbox:
            log.warning("the engine thread did not close its inbox in %.0f s; closed from here", timeout)
            self._inbox = None
            inbox.close()

    def _command(self, cmd: Callable[[], None]) -> None:
        self._cmds.put(cmd)
        if self._sleeping:
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:   # the pipe is full of wakes already
                pass

    def _flush_routed(self) -> None:
        routed, last = self._routed, self._routed_last
        self._routed, self._routed_last = [], []
        if routed:
            try:
                self.on_step(routed)
            except Exception as e:  # noqa: BLE001 - the channel closing (shutdown) must not stop the engine
                log.warning("handing a step's items on failed: %r", e)
        for sink, item in last:
            if sink.loop is not None:   # (a request of submit_routed has no reader to tell)
                sink.loop.call_soon_threadsafe(sink.items.put_nowait, item)

    def _put(self, sink: _Sink, item: StreamItem) -> None:
        if sink.route is None:
            sink.loop.call_soon_threadsafe(sink.items.put_nowait, item)
            return
        if sink.whole:   # one message for many steps: what a reader of the whole answer needs
            if sink.held is None:
                sink.held, sink.held_at = item, time.monotonic()
            else:
                merge_items(sink.held, item)
            held_s = time.monotonic() - sink.held_at
            if not item.finished and len(sink.held.token_ids) < WHOLE_SEND_TOKENS and held_s < WHOLE_SEND_SECONDS:
                return
            item, sink.held = sink.held, None
            item.held_s = held_s
        self._routed.append((sink.route, item))
        if item.finished:
            self._routed_last.append((sink, item))

    def _check(self, when: str) -> None:
        try:
            self.engine.check_integrity()
        except AssertionError as e:
            log.error("integrity broken %s: %s", when, e)
            if len(self.integrity_failures) < 20:
                self.integrity_failures.append(f"{when}: {e}"[:2000])

    def _emit(self, rid: str, toks: list[int], finished: bool, out=None) -> None:
        stream = self._streams.get(rid)
        if stream is None:
            return
        item = StreamItem(rid, toks, finished)
        if out is not None:
            item.logprobs, item.prompt_logprobs = list(out.logprobs), out.prompt_logprobs
        if not finished and (req := self.engine.requests.get(rid)) is not None and len(req.output_ids) == len(toks):
            # the first item: the prompt's hit is known (SGLang's clients read cached_tokens off the first chunk)
            item.cached_tokens, item.cached_tokens_by_tier = req.cached_tokens, dict(req.cached_by_tier)
        if finished:
            req = self.engine.requests[rid]
            out = self.engine.pop_finished(rid)
            item.finish_reason = out.finish_reason
            item.prompt_tokens = out.prompt_tokens
            item.cached_tokens = out.cached_tokens
            item.cached_tokens_by_tier = out.cached_tokens_by_tier
            stream.payload = req.kv_payload
            item.matched_stop = out.matched_stop
            self._streams.pop(rid, None)
            if stream.loop is None:
                self._by_route.pop(stream.route, None)
        self._put(stream, item)

    def _fail_all(self, msg: str) -> None:
        for rid in list(self._streams):
            if rid in self.engine.requests:
                self.engine.abort(rid)
                self.engine.pop_finished(rid)
            self._put(self._streams.pop(rid), StreamItem(rid, [], True, "error", error=msg))
        self._by_route.clear()
        self._flush_routed()

    def call(self, fn: Callable[[Engine], Any]) -> "asyncio.Future":
        """Run ``fn(engine)`` on the engine thread; the result (or exception) comes back as a future."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def cmd() -> None:
            try:
                res = fn(self.engine)
                loop.call_soon_threadsafe(_settle, fut, res, None)
            except BaseException as e:
                loop.call_soon_threadsafe(_settle, fut, None, e)

        self._command(cmd)
        return fut

    def call_blocking(self, fn: Callable[[Engine], Any], timeout: float | None = 30.0) -> Any:
        """``call`` for plain threads (no event loop)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def cmd() -> None:
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:
                fut.set_exception(e)

        self._command(cmd)
        return fut.result(timeout)

    # ---- requests ------------------------------------------------------------------------------------
    async def _stream(self, rid: str, submit: Callable[[Engine], None],
                      sink: _Sink | None = None) -> AsyncIterator[StreamItem]:
        sink = sink or _Sink(asyncio.get_running_loop(), asyncio.Queue())

        def add(eng: Engine) -> bool:
            if self.held():
                return False
            self._streams[rid] = sink
            try:
                submit(eng)
            except BaseException:
                self._streams.pop(rid, None)
                raise
            req = eng.requests.get(rid)
            if req is not None and req.status is Status.FINISHED:  # finished on admission
                self._emit(rid, list(req.output_ids), True)
            return True

        await self.call_admitted(add)
        try:
            while True:
                item = await sink.items.get()
                yield item
                if item.finished:
                    return
        finally:
            if rid in self._streams:  # the consumer went away: stop computing for it
                self._command(lambda: self._abort_now(rid))

    def _abort_now(self, rid: str) -> None:
        sink = self._streams.pop(rid, None)
        if sink is not None and sink.loop is None:
            self._by_route.pop(sink.route, None)
        if rid in self.engine.requests:
            self.engine.abort(rid)
            self.engine.pop_finished(rid)

    def new_rid(self, prefix: str = "r") -> str:
        return f"{prefix}-{next(self._ids)}"

    def _sink(self, route: Any, whole: bool = False) -> _Sink | None:
        if route is None:
            return None
        if self.on_step is None:
            raise ValueError("a routed request needs on_step (where its items go)")
        return _Sink(asyncio.get_running_loop(), asyncio.Queue(), route=route, whole=whole)

    def generate(self, prompt, params: SamplingParams, rid: str | None = None,
                 route: Any = None, whole: bool = False) -> AsyncIterator[StreamItem]:
        """The request's items; with a ``route``, they go to ``on_step`` tagged with it and this yields only
        the last (closing it early aborts the request all the same). ``whole``: a routed request whose
        reader wants only the whole answer; its items go out merged (WHOLE_SEND_TOKENS)."""
        rid = rid or self.new_rid()
        return self._stream(rid, lambda e: e.add_request(prompt, params, rid), self._sink(route, whole))

    def submit_routed(self, prompt, params: SamplingParams, route: Any,
                      refused: Callable[[Any, BaseException], None], whole: bool = False) -> None:
        """``generate`` with a ``route`` for a caller without an event loop (a token channel's reader, the
        engine thread itself with an inbox): queued to the engine thread and returned at once. Every item
        goes to ``on_step``; a request the engine refuses goes to ``refused(route, error)`` instead. A
        flush's hold defers the admission until it ends. ``abort_routed(route)`` stops it. ``whole``: as in
        ``generate``."""
        if self.on_step is None:
            raise ValueError("a routed request needs on_step (where its items go)")
        rid = self.new_rid()

        def add() -> None:
            if self.held():
                self._deferred.append(add)
                return
            sink = _Sink(None, None, route=route, whole=whole)   # type: ignore[arg-type]
            self._streams[rid] = sink
            self._by_route[route] = rid
            try:
                self.engine.add_request(prompt, params, rid)
            except BaseException as e:  # noqa: BLE001 - refused: said to its client, the engine goes on
                self._streams.pop(rid, None)
                self._by_route.pop(route, None)
                refused(route, e)
                return
            req = self.engine.requests.get(rid)
            if req is not None and req.status is Status.FINISHED:  # finished on admission
                self._emit(rid, list(req.output_ids), True)

        add.route = route   # type: ignore[attr-defined]   (abort_routed finds a deferred one by it)
        self._command(add)

    def abort_routed(self, route: Any) -> None:
        """Stop the ``submit_routed`` request of ``route`` (a no-op once it is over)."""
        def stop() -> None:
            rid = self._by_route.pop(route, None)
            if rid is not None:
                self._abort_now(rid)
            else:   # still held back by a flush: never admitted
                self._deferred = [a for a in self._deferred if getattr(a, "route", None) != route]
        self._command(stop)

    async def prefill(self, prompt, params: SamplingParams, rid: str | None = None) -> PrefillResult:
        """Compute the prompt and its first token only, keeping the prompt's KV for a decode engine (a
        P/D prefill worker's half of a request; finish_reason "prefill" unless the first token ends it)."""
        rid = rid or self.new_rid()
        # The sink is this call's own: a caller that leaves takes the payload with it, nothing is kept.
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        last = None
        async for item in self._stream(rid, lambda e: e.add_request(prompt, params, rid, prefill_only=True), sink):
            last = item   # the first token's item is the last: the one handed on
        return PrefillResult(last, sink.payload)

    def decode_leased(self, prompt, lease_id: str, rec: Receipt | None, params: SamplingParams, now: float,
                      backend: TransferBackend, rid: str | None = None, route: Any = None,
                      whole: bool = False) -> AsyncIterator[StreamItem]:
        """Admit a request whose KV ``backend`` fills into the pages of ``lease_id`` from the sender's
        receipt ``rec`` (Engine.add_leased), and stream its tokens (``route``, ``whole``: as in ``generate``)."""
        rid = rid or self.new_rid()
        return self._stream(rid, lambda e: e.add_leased(prompt, lease_id, rec, params, backend, rid, now=now),
                            self._sink(route, whole))

    async def abort(self, rid: str) -> None:
        await self.call(lambda e: self._abort_now(rid))

    # ---- introspection -------------------------------------------------------------------------------
    async def take_events(self) -> list:
        return await self.call(lambda e: e.cache.take_events())

    def load(self) -> WorkerLoad:
        """Racy but cheap snapshot (ints read from another thread) for routing."""
        s = self.engine.scheduler
        queued = sum(r.remaining for r in list(s.waiting)) + sum(r.remaining for r in list(s.running)
                                                                  if not r.is_decoding)
        full, cache = self.engine.pools.full, self.engine.cache
        if cache.host is None:
            return WorkerLoad(queued, len(s.running), len(s.waiting), full.allocator.num_free, full.num_pages)
        return WorkerLoad(queued, len(s.running), len(s.waiting), full.allocator.num_free, full.num_pages,
                          host_kv_bytes=sum(cache.host.bytes_used().values()),
                          kv_moved_bytes=dict(cache.stats["bytes"]),
                          kv_loadback_pages=dict(cache.stats["loadback"]))   # loaded / used / wasted L2 -> L1

    async def stats(self) -> dict:
        return await self.call(lambda e: e.stats())

    # ---- flush: hold (phase one), flush, release ----------------------------------------------------
    def held(self) -> bool:
        return time.monotonic() < self._held_until

    async def call_admitted(self, fn: Callable[[Engine], Any]) -> Any:
        """``call(fn)`` for a new request's admission: ``fn`` returns False (and does nothing) while a
        flush holds admissions; it is tried again until the hold ends. The check runs on the engine
        thread, so no request slips in between a hold's idle check and the flush."""
        while True:
            res = await self.call(fn)
            if res is not False:
                return res
            await asyncio.sleep(0.01)

    @staticmethod
    def busy(e: Engine) -> str | None:
        """Why ``e`` cannot be flushed now (None: idle). A live lease is a request between prefill and
        decode: it would put its KV in the tree after the flush."""
        s = e.scheduler
        if s.running or s.waiting:
            return f"{len(s.running)} running, {len(s.waiting)} waiting"
        live = e.receiver.live
        return f"{live} KV transfer leases held" if live else None

    async def hold(self, seconds: float) -> str | None:
        """Phase one of a flush: when idle, admit nothing new for up to ``seconds`` (until ``release``)
        and return None; else return why not (and hold nothing)."""
        def f(e: Engine) -> str | None:
            why = self.busy(e)
            if why is None:
                self._held_until = time.monotonic() + seconds
            return why
        return await self.call(f)

    def release(self) -> None:
        """End a hold: waiting admissions go ahead."""
        self._held_until = 0.0

    async def flush_cache(self, l3: bool = False) -> dict:
        """Flush when idle: ``{"flushed": True, "L1": ..., "L2": ..., "L3": ..., "L3_store": ...}`` (see
        Engine.flush_cache), or ``{"flushed": False, "reason": ...}`` with nothing flushed."""
        def flush(e: Engine) -> dict:
            why = self.busy(e)
            if why is not None:
                return {"flushed": False, "reason": why}
            return {"flushed": True, **e.flush_cache(l3=l3)}
        return await self.call(flush)

    def close(self) -> None:
        self._stop = True
        self._command(lambda: None)
        self._thread.join(timeout=5)
        self.engine.close()
        if not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)
