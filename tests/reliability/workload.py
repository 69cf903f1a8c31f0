"""The multi-turn load the soak and the fault tests drive over HTTP: several clients, each holding a
conversation whose history grows turn by turn (so later turns hit the prefix cache, L1/L2/L3), mixing
/generate and /v1/completions, streamed and not, and some clients hanging up mid-stream.

Every outcome is recorded. Greedy requests keep (prompt, max_new_tokens, tokens) so ``judge.verify`` can
compare them, after the run, with an offline ``Engine.generate`` on the same model."""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

OK, ABORTED, ERROR, HUNG = "ok", "aborted", "error", "hung"


@dataclass
class Outcome:
    kind: str                      # ok | aborted (we hung up) | error (clean HTTP/SSE error) | hung
    endpoint: str
    stream: bool
    prompt: list[int]
    max_new: int
    tokens: list[int]
    started: float
    ended: float
    status: int = 0
    detail: str = ""
    text: str | None = None        # /v1/completions answers text, not ids: compared as text
    meta: dict | None = None       # /generate's meta_info (route: prefill/decode worker, cache tiers)


@dataclass
class LoadConfig:
    clients: int = 3
    abort_prob: float = 0.15       # a streamed request is cut by the client after a few chunks
    stream_prob: float = 0.5
    min_new: int = 4
    max_new: int = 24
    max_history: int = 900         # a conversation this long starts over (new system prefix)
    think_s: float = 0.05          # pause between a client's turns
    request_timeout: float = 120.0  # past this a request counts as hung
    vocab: int = 256               # user tokens are drawn from the byte range


@dataclass
class Recorder:
    outcomes: list[Outcome] = field(default_factory=list)

    def add(self, o: Outcome) -> None:
        self.outcomes.append(o)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for o in self.outcomes:
            out[o.kind] = out.get(o.kind, 0) + 1
        return out

    def between(self, t0: float, t1: float) -> list[Outcome]:
        """Requests in flight at some moment of [t0, t1]."""
        return [o for o in self.outcomes if o.started <= t1 and o.ended >= t0]


class Gate:
    """Lets the soak pause new requests (to flush the cache, which needs idle workers) without
    stopping the clients."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.inflight = 0

    async def enter(self) -> None:
        await self._open.wait()
        self.inflight += 1

    def leave(self) -> None:
        self.inflight -= 1

    async def close_and_drain(self, timeout: float = 120.0) -> None:
        self._open.clear()
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def open(self) -> None:
        self._open.set()


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_new: int, endpoint: str,
                      stream: bool, abort_after: int | None, timeout: float) -> Outcome:
    """One greedy request; ``abort_after``: hang up after that many streamed events."""
    t0 = time.monotonic()
    if endpoint == "/generate":
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new, "temperature": 0},
                "stream": stream}
    else:
        body = {"prompt": prompt, "max_tokens": max_new, "temperature": 0, "stream": stream}
    o = Outcome(OK, endpoint, stream, prompt, max_new, [], t0, t0)
    try:
        async with asyncio.timeout(timeout):
            if not stream:
                r = await client.post(url + endpoint, json=body)
                o.status = r.status_code
                if r.status_code != 200:
                    o.kind, o.detail = ERROR, r.text[:200]
                elif endpoint == "/generate":
                    o.tokens, o.meta = r.json()["output_ids"], r.json().get("meta_info")
                else:
                    o.text = r.json()["choices"][0]["text"]
            else:
                await _stream(client, url + endpoint, body, endpoint, abort_after, o)
    except TimeoutError:
        o.kind, o.detail = HUNG, f"no answer in {timeout:.0f}s"
    except (httpx.TransportError, httpx.StreamError) as e:
        # The connection itself broke (the ingress replica died): the client sees it at once.
        o.kind, o.detail = ERROR, f"connection: {type(e).__name__}"
    o.ended = time.monotonic()
    return o


async def _stream(client, url, body, endpoint, abort_after, o: Outcome) -> None:
    async with client.stream("POST", url, json=body) as r:
        o.status = r.status_code
        if r.status_code != 200:
            o.kind, o.detail = ERROR, (await r.aread()).decode(errors="replace")[:200]
            return
        events, done = 0, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            ev = json.loads(line[6:])
            if "error" in ev:
                o.kind, o.detail = ERROR, ev["error"]["message"][:200]
                continue
            if endpoint == "/generate":
                o.tokens = ev["output_ids"]
                o.meta = ev.get("meta_info") or o.meta
            else:
                o.text = (o.text or "") + (ev["choices"][0]["text"] if ev["choices"] else "")
            events += 1
            if abort_after is not None and events >= abort_after:
                o.kind = ABORTED
                return  # leaving the block closes the connection mid-stream
        if not done and o.kind == OK:
            o.kind, o.detail = ERROR, "connection: stream ended without [DONE]"


async def client_loop(cid: int, url: str, cfg: LoadConfig, rec: Recorder, stop: asyncio.Event, gate: Gate,
                      seed: int) -> None:
    rng = random.Random(seed * 7919 + cid)
    limits = httpx.Limits(max_connections=4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout), limits=limits) as client:
        history: list[int] = []
        while not stop.is_set():
            if not history or len(history) > cfg.max_history:
                history = [rng.randrange(cfg.vocab) for _ in range(rng.randint(40, 200))]
            history = history + [rng.randrange(cfg.vocab) for _ in range(rng.randint(8, 48))]
            stream = rng.random() < cfg.stream_prob
            abort_after = rng.randint(1, 4) if stream and rng.random() < cfg.abort_prob else None
            endpoint = "/generate" if rng.random() < 0.7 else "/v1/completions"
            max_new = rng.randint(cfg.min_new, cfg.max_new)
            await gate.enter()
            try:
                o = await one_request(client, url, history, max_new, endpoint, stream, abort_after,
                                      cfg.request_timeout)
            finally:
                gate.leave()
            rec.add(o)
            if o.kind == OK and o.text is None:
                history = history + o.tokens  # the next turn carries the answer, as a chat does
            await asyncio.sleep(cfg.think_s * rng.random())


class Load:
    """The clients running on their own event loop in a background thread, so a synchronous test (or
    the soak's schedule) can inject faults, flush and measure while they run."""

    def __init__(self, url: str, cfg: LoadConfig, seed: int = 0) -> None:
        import threading
        self.url, self.cfg, self.seed = url, cfg, seed
        self.rec = Recorder()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-load", daemon=True)

    def __enter__(self) -> "Load":
        self._thread.start()
        self._ready.wait()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._stop, self.gate = asyncio.Event(), Gate()
        self._ready.set()
        tasks = [client_loop(i, self.url, self.cfg, self.rec, self._stop, self.gate, self.seed)
                 for i in range(self.cfg.clients)]
        self._loop.run_until_complete(asyncio.gather(*tasks))

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=self.cfg.request_timeout + 30)

    def paused(self):
        """``with load.paused(): ...`` holds new requests and waits for those in flight."""
        import contextlib

        @contextlib.contextmanager
        def cm():
            asyncio.run_coroutine_threadsafe(self.gate.close_and_drain(), self._loop).result()
            try:
                yield
            finally:
                self._loop.call_soon_threadsafe(self.gate.open)
        return cm()
