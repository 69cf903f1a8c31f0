"""The multi-turn load the soak and the fault tests drive over HTTP: several clients, each holding a
conversation whose history grows turn by turn (so later turns hit the prefix cache, L1/L2/L3), mixing
/generate and /v1/completions, streamed and not, and some clients hanging up mid-stream.

Every outcome is recorded. Greedy requests keep (prompt, max_new_tokens, tokens) so ``verify`` can
compare them, after the run, with an offline ``Engine.generate`` on the same model: a completed request
must match exactly, an aborted or failed stream must be a prefix of the right answer."""
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


def verify(rec: Recorder, reference, limit: int | None = None, seed: int = 0) -> dict:
    """Compare greedy outputs with ``reference`` (an offline Engine on the same model). Returns
    {"checked", "wrong": [...], "near_ties": [...]}; an ok request must match exactly, any other a
    prefix, except that a departure at a near-tie of the reference's logits, after which the reference
    continues the cluster's own tokens, is a correct answer (``explain_by_ties``) reported apart."""
    from engine import SamplingParams

    cands = [o for o in rec.outcomes if o.tokens or o.text or (o.kind == OK)]
    if limit is not None and len(cands) > limit:
        cands = random.Random(seed).sample(cands, limit)
    # Answers are memoized on the reference across calls (fault tests, then the soak, judge the same
    # requests); computed in prompt order so a conversation's turns reuse the reference's prefix cache.
    memo: dict[tuple, list[int]] = reference.__dict__.setdefault("_reliability_memo", {})
    todo = sorted({(tuple(o.prompt), o.max_new) for o in cands} - set(memo))
    for i in range(0, len(todo), 4):  # in order, small batches: a turn finds earlier turns cached
        chunk = todo[i:i + 4]
        outs = reference.generate([list(p) for p, _ in chunk],
                                  [SamplingParams(max_new_tokens=n, temperature=0.0) for _, n in chunk])
        memo.update({k: o.token_ids for k, o in zip(chunk, outs)})
    wrong, ties = [], []
    for o in cands:
        want, got = memo[(tuple(o.prompt), o.max_new)], o.tokens
        if o.text is not None or o.endpoint != "/generate":
            want, got = reference.tokenizer.decode(want), o.text or ""
        ok = got == want if o.kind == OK else got == want[:len(got)]
        if ok:
            continue
        tie = explain_by_ties(reference, o) if isinstance(got, list) else None
        if tie is None or not tie["explained"]:
            rt = explain_by_routing_tie(reference, o)
            if rt is not None:
                tie = {**(tie or {}), **rt}
        entry = {"kind": o.kind, "endpoint": o.endpoint, "stream": o.stream, "prompt_len": len(o.prompt),
                 "got": got[:16], "want": want[:16], "prompt": list(o.prompt), "max_new": o.max_new,
                 "started": round(o.started, 2), "ended": round(o.ended, 2),   # time.monotonic()
                 "meta": o.meta, **(tie or {})}
        (ties if tie is not None and tie["explained"] else wrong).append(entry)
    return {"checked": len(cands), "wrong": wrong, "near_ties": ties}


# Two correct computations of one sequence (alone or batched, prefix recomputed or read back from a
# cache tier) differ in their fp32 logits by up to ~1e-4 (measured: median 1.2e-5, max 8.3e-5 over 3840
# tokens of soak-like conversations), so at a near-tie greedy decoding may pick either token. A wrong KV
# page moves logits by far more than this.
TIE_TOLERANCE = 1e-3


def explain_by_ties(reference, o: Outcome, tol: float = TIE_TOLERANCE, max_ties: int = 3) -> dict:
    """Whether a greedy answer that differs from the reference's is still a correct one: at each point
    where it departs, the reference's logit of the token the cluster chose must be within ``tol`` of its
    top logit (a near-tie), and from there the reference, continuing the cluster's own tokens, must
    reproduce the rest. Returns the divergence points, their margins and ``explained``."""
    from engine import SamplingParams
    got, points = list(o.tokens), []
    start = 0   # got[:start] is already explained
    while True:
        ctx = list(o.prompt) + got[:start]
        n = o.max_new - start
        if n <= 0 or start >= len(got):
            return {"explained": True, "near_ties": points}
        ref = reference.generate([ctx], SamplingParams(max_new_tokens=n, temperature=0.0, return_logits=True))[0]
        tail, want = got[start:], ref.token_ids
        k = next((i for i, (a, b) in enumerate(zip(tail, want)) if a != b), None)
        if k is None:   # the rest agrees (a shorter answer must be a prefix: aborted, or a stop token)
            ok = len(tail) <= len(want) if o.kind != OK else tail == want
            return {"explained": ok, "near_ties": points}
        logits = ref.logits[k].float()
        gap = float(logits.max() - logits[tail[k]])
        points.append({"at": start + k, "ref_token": want[k], "got_token": tail[k], "ref_margin": round(gap, 6)})
        if gap > tol or len(points) > max_ties:
            return {"explained": False, "near_ties": points}
        start += k + 1


# Top-k MoE routing has near-ties too: a token's k-th and (k+1)-th expert logits can be 2e-7 apart, and
# the ~1e-6 noise between batch shapes (chunked or one-step prefill, other requests in the step) then
# picks the other expert; everything after that layer follows. Under this gap a routing decision is a tie.
ROUTER_TIE = 1e-5


def explain_by_routing_tie(reference, o: Outcome, tol: float = ROUTER_TIE) -> dict | None:
    """Whether an answer that departs from the reference is the model's answer with its closest routing
    tie broken the other way: the prompt is prefilled in one step, the token and layer with the smallest
    gap between the k-th and (k+1)-th router logit is found; if that gap is under ``tol``, the two experts
    are swapped there (nothing else) and the answer regenerated. None when there is no such tie."""
    import dataclasses

    from engine import Engine, SamplingParams
    from engine.model.moe import TopKRouter
    eng = reference.__dict__.get("_one_step")
    if eng is None:   # one-step prefill: token positions are the rows of the prefill step
        eng = Engine(dataclasses.replace(reference.cfg, max_batch_tokens=8192, enable_prefix_cache=False,
                                         hicache=None, eplb=None))
        reference.__dict__["_one_step"] = eng
    routers = [m for m in eng.model.modules() if isinstance(m, TopKRouter)]
    state: dict = {"flip": None, "best": None}

    def hooked(layer: int, router: TopKRouter):
        def forward(x):
            logits = nn_linear(x, router.weight, router.bias)
            k = router.top_k
            if x.shape[0] > 1:   # the prefill step
                v, idx = logits.sort(-1, descending=True)
                gaps = v[:, k - 1] - v[:, k]
                row = int(gaps.argmin())
                if state["best"] is None or float(gaps[row]) < state["best"][0]:
                    state["best"] = (float(gaps[row]), layer, row)
                if state["flip"] is not None and state["flip"][0] == layer:
                    r = state["flip"][1]
                    a, b = idx[r, k - 1], idx[r, k]
                    logits = logits.clone()
                    logits[r, a], logits[r, b] = logits[r, b].clone(), logits[r, a].clone()
            top_v, top_i = torch_topk(logits, k)
            return top_v.softmax(-1), top_i
        return forward

    from torch import topk as _topk
    from torch.nn.functional import linear as nn_linear

    def torch_topk(t, k):
        return _topk(t, k, dim=-1)

    def matches(ids: list[int]) -> bool:
        if o.text is not None or o.endpoint != "/generate":
            want, got = reference.tokenizer.decode(ids), o.text or ""
        else:
            want, got = ids, list(o.tokens)
        return got == want if o.kind == OK else got == want[:len(got)]

    for i, r in enumerate(routers):
        r.forward = hooked(i, r)
    try:
        sp = SamplingParams(max_new_tokens=o.max_new, temperature=0.0)
        base = eng.generate([list(o.prompt)], sp)[0].token_ids
        if state["best"] is None or state["best"][0] >= tol:
            return None
        gap, layer, row = state["best"]
        tie = {"layer": layer, "position": row, "gap": gap}
        if matches(base):   # the batched reference broke the tie, not the cluster
            return {"explained": True, "routing_tie": {**tie, "broken_by": "reference"}}
        state["flip"] = (layer, row)
        flipped = eng.generate([list(o.prompt)], sp)[0].token_ids
    finally:
        for r in routers:
            del r.forward
    return {"explained": matches(flipped), "routing_tie": tie}


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
