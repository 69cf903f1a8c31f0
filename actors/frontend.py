"""The Frontend: what every HTTP adapter (actors/openai_api.py, actors/sglang_api.py) shares between a
typed request and the backend's token streams: prompt checks, admission, metrics, retries, parallel
samples (n > 1) and the text a client sees (stop strings trimmed, held back while streaming).

The backend is the cluster (actors/ingress.py ``RayBackend``) or anything with its shape."""
from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Protocol

from fastapi import HTTPException

from actors.metrics import Metrics
from actors.served import Served, ServedStream
from engine.stream import StreamItem
from engine.sampling import SamplingParams


class ServiceUnavailable(Exception):
    """The cluster cannot take the request now (no live worker, pools full): HTTP 503."""


class WorkerFailed(RuntimeError):
    """A worker serving the request died; ``workers`` names the ones to avoid on a retry."""

    def __init__(self, msg: str, workers: tuple[str, ...] = ()) -> None:
        super().__init__(msg)
        self.workers = workers


class Backend(Protocol):
    model_name: str
    max_context: int
    vocab_size: int
    tokenizer: object    # engine.model.tokenizer.TextTokenizer
    sampling_defaults: dict   # the checkpoint's generation_config.json defaults (engine/model/loader.py)

    def stream(self, ids: list[int], params: SamplingParams, avoid: tuple[str, ...] = (),
               pin: Served | None = None, whole: bool = False) -> ServedStream:
        """The request's items, and (from its first item on) which workers serve it. ``avoid``: workers
        that just failed it; ``pin``: serve it where an earlier sample of the prompt was served; ``whole``:
        nothing is sent before the answer is whole, so its items may come merged (an item's ``held_s``
        says how long its first token waited)."""
    async def health(self) -> dict: ...
    async def flush_cache(self) -> dict: ...   # {"flushed": bool, ...} (actors/flush.py)
    async def gauges(self) -> dict: ...
    async def server_info(self) -> dict: ...


def bad(field: str, msg: str) -> HTTPException:
    """A 400 whose message and ``param`` name the field (OpenAI's error object, actors/openai_errors.py)."""
    return HTTPException(400, {"message": f"{field}: {msg}", "param": field})


def stable_delta(text: str, sent: str, finished: bool) -> tuple[str, str]:
    """The new text to stream and what has been sent after it. A trailing U+FFFD is an incomplete
    UTF-8 sequence (byte-level tokens split characters): hold it back until the next bytes complete it
    or the stream ends, so the deltas add up to the final text."""
    if not finished:
        text = text.rstrip("\ufffd")
    if not text.startswith(sent):  # cannot retract what was sent; resume after the common prefix
        n = 0
        while n < min(len(text), len(sent)) and text[n] == sent[n]:
            n += 1
        return text[max(n, len(sent)):] if len(text) > len(sent) else "", sent + text[max(n, len(sent)):]
    return text[len(sent):], text


def visible_text(text: str, stops: tuple[str, ...], finished: bool, keep_stop: bool) -> tuple[str, str | None]:
    """What of a completion's decoded ``text`` the client may see, and the stop string that ended it.
    Cut at the first stop string (kept only with ``keep_stop``); while unfinished, also hold back a tail
    that could be the start of a stop string, so a stop string never leaks into a streamed chunk."""
    hit, at = None, len(text)
    for s in stops:
        i = text.find(s)
        if 0 <= i < at or (i == at and hit is not None and len(s) > len(hit)):
            hit, at = s, i
    if hit is not None:
        return text[:at + (len(hit) if keep_stop else 0)], hit
    if not finished and stops:
        text = text.rstrip("\ufffd")   # an incomplete character may yet complete a stop string
        hold = max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)
        text = text[:len(text) - hold]
    return text, None


@dataclass
class Sample:
    """One completion as it streams in: tokens, logprobs and the final accounting."""
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    last: StreamItem | None = None
    served: Served | None = None   # which workers serve it, known from its first item on
    sent: str = ""

    def feed(self, item: StreamItem) -> None:
        self.token_ids += item.token_ids
        self.logprobs += list(getattr(item, "logprobs", None) or ())
        if getattr(item, "prompt_logprobs", None) is not None:
            self.prompt_logprobs = list(item.prompt_logprobs)
        if self.last is not None and not item.cached_tokens and not item.cached_tokens_by_tier:
            # the hit came with the first item: every chunk after it says it too (SGLang's meta_info)
            item.cached_tokens, item.cached_tokens_by_tier = self.last.cached_tokens, self.last.cached_tokens_by_tier
        self.last = item

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    @property
    def finish_reason(self) -> str | None:
        return self.last.finish_reason if self.finished else None

    @property
    def matched_stop(self):
        return getattr(self.last, "matched_stop", None) if self.last else None

    def text(self, tok, keep_stop: bool | None = None) -> tuple[str, str | None]:
        p = self.params
        full = tok.decode(self.token_ids, skip_special_tokens=p.skip_special_tokens)
        return visible_text(full, p.stop, self.finished, p.no_stop_trim if keep_stop is None else keep_stop)

    def delta(self, tok) -> str:
        """The next piece of text to stream (pieces add up to the final text)."""
        text, _ = self.text(tok)
        d, self.sent = stable_delta(text, self.sent, self.finished)
        return d


class Frontend:
    def __init__(self, backend: Backend, metrics: Metrics | None = None, max_inflight: int = 256) -> None:
        self.backend, self.metrics, self.max_inflight = backend, metrics or Metrics(), max_inflight
        self.sampling_defaults = dict(getattr(backend, "sampling_defaults", None) or {})
        self.inflight = 0
        # Set when the server stops (SIGINT/SIGTERM): new requests get 503 while those in flight finish.
        self.draining = False
        self._generated: collections.deque = collections.deque()   # (time, tokens) of the last seconds

    def internal_state(self, window: float = 10.0) -> dict:
        """What SGLang's tooling reads from /get_server_info's ``internal_states[0]``: the recent decode
        throughput (tokens/s over the last ``window`` seconds); no speculative decoding, so every step
        accepts one token."""
        now = time.monotonic()
        while self._generated and self._generated[0][0] < now - window:
            self._generated.popleft()
        return {"last_gen_throughput": sum(n for _t, n in self._generated) / window,
                "avg_spec_accept_length": 1.0, "step_time_dict": {}, "inflight_requests": self.inflight}

    @property
    def tok(self):
        return self.backend.tokenizer

    # ---- prompts ----------------------------------------------------------------------------------
    def encode(self, text: str, field: str, add_special_tokens: bool = False) -> list[int]:
        try:
            return self.tok.encode(text, add_special_tokens) if add_special_tokens else self.tok.encode(text)
        except (UnicodeError, TypeError, ValueError) as e:  # e.g. a lone surrogate ("\\ud800") in JSON
            raise bad(field, f"not encodable text ({type(e).__name__})") from None

    def check_ids(self, ids: list[int], field: str = "prompt") -> list[int]:
        b = self.backend
        if not ids:
            raise bad(field, "empty")
        out = [t for t in ids if not 0 <= t < b.vocab_size]
        if out:
            raise bad(field, f"token id {out[0]} is outside the vocabulary [0, {b.vocab_size})")
        if len(ids) >= b.max_context:
            raise bad(field, f"{len(ids)} tokens exceed the context of {b.max_context}")
        return ids

    def fit(self, ids: list[int], max_new: int | None, field: str, default: int) -> int:
        """Tokens to generate: what was asked, if prompt and completion fit the context (else 400); a
        default shrinks to what fits, since the client did not ask for it."""
        room = self.backend.max_context - len(ids)
        if max_new is None:
            return max(0, min(default, room))
        if max_new > room:
            raise bad(field, f"{len(ids)} prompt tokens + {max_new} new tokens exceed the context of "
                             f"{self.backend.max_context}")
        return max_new

    def check_model(self, model: str | None) -> None:
        if model not in (None, "", self.backend.model_name):
            raise HTTPException(404, {"message": f"The model `{model}` does not exist: this server serves "
                                                 f"`{self.backend.model_name}`", "code": "model_not_found",
                                      "param": "model"})

    def check_lora(self, lora: str | None, field: str = "lora_path") -> None:
        if lora not in (None, ""):
            raise bad(field, f"no LoRA adapter {lora!r} is loaded (this server has none)")

    @staticmethod
    def params(field: str = "sampling_params", **kw) -> SamplingParams:
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            raise bad(field, str(e)) from None

    # ---- serving ----------------------------------------------------------------------------------
    async def run(self, s: Sample, avoid: tuple[str, ...] = (), pin: Served | None = None,
                  whole: bool = False) -> AsyncIterator[StreamItem]:
        """Admission control, metrics and error mapping around the backend's stream of sample ``s``;
        which workers serve it is kept on ``s`` (``s.served``) once its first item arrived. ``whole``:
        Backend.stream's (a non-streamed answer)."""
        if self.draining:
            raise HTTPException(503, "shutting down: this server takes no new requests")
        if self.inflight >= self.max_inflight:
            raise HTTPException(503, f"server busy: {self.max_inflight} requests in flight")
        self.inflight += 1
        m = self.metrics
        t0 = time.perf_counter()
        first = last = None
        try:
            items = self.backend.stream(s.prompt_ids, s.params, avoid, pin, whole)
            async for item in items:
                s.served = items.served
                now = time.perf_counter()
                if item.error:
                    m.inc("strata_request_errors_total")
                    raise RuntimeError(item.error)
                if item.token_ids:
                    self._generated.append((time.monotonic(), len(item.token_ids)))
                    while self._generated[0][0] < self._generated[-1][0] - 60.0:
                        self._generated.popleft()
                    n = len(item.token_ids)
                    if first is None:
                        # A merged item's first token was made held_s before it came (WHOLE_SEND_TOKENS).
                        first = now - min(item.held_s, now - t0)
                        m.observe("strata_ttft_seconds", first - t0)
                        if n > 1:
                            m.observe("strata_inter_token_seconds", (now - first) / (n - 1))
                    elif last is not None:
                        m.observe("strata_inter_token_seconds", (now - last) / n)
                    last = now
                if item.finished:
                    m.inc("strata_requests_total")
                    for tier, n in (item.cached_tokens_by_tier or {}).items():
                        m.inc("strata_cache_hit_tokens_total", n, tier=tier)
                    m.inc("strata_prompt_tokens_total", item.prompt_tokens)
                yield item
        finally:
            self.inflight -= 1

    @staticmethod
    async def first_or_error(gen: AsyncIterator[StreamItem], retryable: bool = False):
        """Start the stream before answering, so admission errors become HTTP errors, not broken SSE.
        ``retryable``: let WorkerFailed through to a caller that retries."""
        try:
            return await gen.__anext__()
        except StopAsyncIteration:
            return None
        except WorkerFailed as e:
            if retryable:
                raise
            raise HTTPException(503, f"request failed: {e}") from None
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        except (MemoryError, ServiceUnavailable) as e:
            raise HTTPException(503, str(e)) from None

    async def collect(self, sample: Sample, pin: Served | None = None) -> Sample:
        """A whole (non-streamed) completion. Nothing was sent yet, so a request whose worker died is
        retried once, routed away from the workers that failed."""
        avoid: tuple[str, ...] = ()
        for attempt in range(2):
            s = replace(sample, token_ids=[], logprobs=[], prompt_logprobs=None, last=None, served=None)
            try:
                gen = self.run(s, avoid, pin, whole=True)
                item = await self.first_or_error(gen, retryable=True)
                while item is not None:
                    s.feed(item)
                    if item.finished:
                        break
                    item = await gen.__anext__()
                return s
            except WorkerFailed as e:
                self.metrics.inc("strata_request_retries_total")
                if attempt:
                    raise HTTPException(503, f"request failed: {e}") from None
                avoid, pin = e.workers, None
            except RuntimeError as e:
                raise HTTPException(503, f"request failed: {e}") from None
        raise AssertionError("unreachable")

    async def warm(self, ids: list[int], n: int) -> tuple[Served | None, StreamItem | None]:
        """Before n > 1 samples of one prompt: prefill it once (one token, greedy), so that the samples,
        sent to the same workers, share its KV through the prefix cache instead of n prefills. Returns
        the workers that served it (the samples' pin) and the warm-up's final item (its cache hit is the
        request's)."""
        if n <= 1:
            return None, None
        s = await self.collect(Sample(0, ids, SamplingParams(max_new_tokens=1, ignore_eos=True)))
        return s.served, s.last

    def samples(self, ids: list[int], params: SamplingParams, n: int, first_index: int = 0) -> list[Sample]:
        """n samples of one prompt; a seeded request's samples get seeds seed, seed+1, ... (each one
        reproducible on its own)."""
        out = []
        for i in range(n):
            p = params if params.seed is None or i == 0 else replace(params, seed=(params.seed + i) % 2**63)
            out.append(Sample(first_index + i, ids, p))
        return out

    async def collect_all(self, samples: list[Sample], pins: list[Served | None]) -> list[Sample]:
        return list(await asyncio.gather(*(self.collect(s, p) for s, p in zip(samples, pins))))

    async def start_streams(self, samples: list[Sample], pins: list[Served | None]) -> list:
        """Open every sample's stream and wait for its first item (errors before anything is sent are
        HTTP errors). Returns [(sample, generator, first item)]."""
        gens = [self.run(s, (), p) for s, p in zip(samples, pins)]
        try:
            firsts = await asyncio.gather(*(self.first_or_error(g) for g in gens))
        except BaseException:
            for g in gens:
                await g.aclose()
            raise
        return list(zip(samples, gens, firsts))

    @staticmethod
    async def merged(started: list) -> AsyncIterator[tuple[Sample, StreamItem]]:
        """Interleave the samples' streams as their items arrive; each sample's items in order."""
        q: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(s: Sample, gen, first):
            try:
                item = first
                while item is not None:
                    await q.put((s, item))
                    if item.finished:
                        break
                    item = await gen.__anext__()
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await q.put((s, e))
            finally:
                await q.put((s, done))

        tasks = [asyncio.create_task(pump(*x)) for x in started]
        left = len(tasks)
        try:
            while left:
                s, item = await q.get()
                if item is done:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield s, item
        finally:
            for t in tasks:
                t.cancel()
            for _s, gen, _f in started:
                await gen.aclose()
