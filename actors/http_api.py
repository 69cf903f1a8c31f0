"""The HTTP API (FastAPI), independent of how requests are served: OpenAI-compatible
/v1/completions, /v1/chat/completions and /v1/models, SGLang-compatible /generate, /health, /metrics,
/flush_cache. A ``Backend`` does the serving (the Ray ingress plugs in the cluster)."""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, AsyncIterator, Literal, Optional, Protocol, Union

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.http_body import DEFAULT_MAX_BODY_BYTES, BodyLimit
from actors.http_models import (ChatCompletionChunk, ChatCompletionResponse, CompletionChunk,
                                CompletionResponse, FlushResult, GenerateChunk, GenerateResponse, Health,
                                ModelList, errors, finish_openapi, sse_200)
from actors.metrics import Metrics
from engine.async_engine import StreamItem
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

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def chat_prompt(self, messages: list[dict]) -> str: ...
    def stream(self, ids: list[int], params: SamplingParams, avoid: tuple[str, ...] = ()) -> AsyncIterator[StreamItem]: ...
    async def health(self) -> dict: ...
    async def flush_cache(self) -> bool: ...
    async def gauges(self) -> dict: ...


def _only(typ, value):
    """A field strata accepts at its neutral value only. Not ``Literal``: it compares with ==, so it would
    take 0 for False and False for 0."""
    def check(v):
        if v != value:
            raise ValueError(f"only {value!r} is supported")
        return v
    return Annotated[typ, Field(json_schema_extra={"const": value}), AfterValidator(check)]


class _Strict(BaseModel):
    # strict: a JSON value of the wrong type is refused ("5" for an int, true for a token id), never
    # coerced into something the client did not send.
    model_config = ConfigDict(extra="forbid", strict=True)


class SGLSampling(_Strict):
    max_new_tokens: int = Field(128, ge=0, le=1 << 20)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    seed: Optional[int] = Field(None, ge=0, le=2**63 - 1)
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    min_new_tokens: int = Field(0, ge=0, le=0)           # accepted at its neutral value only
    n: int = Field(1, ge=1, le=1)


class GenerateRequest(_Strict):
    text: Optional[str] = None
    input_ids: Optional[list[int]] = None
    sampling_params: SGLSampling = Field(default_factory=SGLSampling)
    stream: bool = False
    rid: Optional[str] = None
    # SGLang fields strata does not implement: only their neutral values are accepted.
    lora_path: Optional[None] = None
    return_logprob: _only(bool, False) = False
    logprob_start_len: _only(int, -1) = -1
    top_logprobs_num: _only(int, 0) = 0
    return_text_in_logprobs: bool = False
    stream_options: Optional[None] = None
    image_data: Optional[None] = None


class _OpenAIRequest(_Strict):
    """Fields both OpenAI endpoints share (unimplemented ones only at their neutral values)."""

    model: Optional[str] = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    seed: Optional[int] = Field(None, ge=0, le=2**63 - 1)
    user: Optional[str] = None
    stop: Optional[None] = None
    stream_options: Optional[dict] = None


class CompletionRequest(_OpenAIRequest):
    prompt: Union[str, list[int]]
    max_tokens: int = Field(16, ge=0, le=1 << 20)
    logprobs: Optional[None] = None
    echo: _only(bool, False) = False


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str
    name: Optional[str] = None


class ChatRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=0, le=1 << 20)
    max_completion_tokens: Optional[int] = Field(None, ge=0, le=1 << 20)

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, v):
        if not any(m.content for m in v):
            raise ValueError("messages: every message is empty")
        return v


def _params(max_new: int, temperature: float, top_p: float, top_k: int, seed, stop_ids, ignore_eos) -> SamplingParams:
    try:
        return SamplingParams(max_new_tokens=max_new, temperature=float(temperature), top_p=float(top_p),
                              top_k=max(0, top_k), seed=seed, stop_token_ids=tuple(stop_ids or ()),
                              ignore_eos=ignore_eos)
    except ValueError as e:
        raise HTTPException(400, str(e)) from None


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


def build_app(backend: Backend, metrics: Metrics | None = None, max_inflight: int = 256,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="strata", version="0.1.0")
    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes)
    metrics = metrics or Metrics()
    state = {"inflight": 0}

    @app.middleware("http")
    async def _json_bodies(request: Request, call_next):
        # `curl -d '{...}'` sends form encoding by default; every POST body of this API is JSON.
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if request.method == "POST" and ctype in ("", "application/x-www-form-urlencoded"):
            request.scope["headers"] = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"] \
                + [(b"content-type", b"application/json")]
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError):
        errs = [{"field": ".".join(str(x) for x in e.get("loc", ())[1:]), "msg": e.get("msg")} for e in exc.errors()]
        return JSONResponse({"error": {"message": "invalid request", "type": "invalid_request_error",
                                       "details": errs}}, status_code=422)

    # Starlette's own HTTPException too (a body that is not UTF-8 JSON, 404, 405): one error shape.
    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException):
        return JSONResponse({"error": {"message": str(exc.detail), "type": "invalid_request_error",
                                       "code": exc.status_code}}, status_code=exc.status_code)

    def encode(text: str, field: str) -> list[int]:
        try:
            return backend.encode(text)
        except (UnicodeError, TypeError, ValueError) as e:  # e.g. a lone surrogate ("\\ud800") in JSON
            raise HTTPException(400, f"{field}: not encodable text ({type(e).__name__})") from None

    def fit(ids: list[int], max_new: int | None, field: str, default: int) -> int:
        """Tokens to generate: what was asked, if prompt and completion fit the context (else 400); a
        default shrinks to what fits, since the client did not ask for it."""
        room = backend.max_context - len(ids)
        if max_new is None:
            return max(0, min(default, room))
        if max_new > room:
            raise HTTPException(400, f"{field}: {len(ids)} prompt tokens + {max_new} new tokens exceed the "
                                     f"context of {backend.max_context}")
        return max_new

    def check_ids(ids: list[int]) -> list[int]:
        if not ids:
            raise HTTPException(400, "prompt: empty")
        bad = [t for t in ids if not 0 <= t < backend.vocab_size]
        if bad:
            raise HTTPException(400, f"prompt: token id {bad[0]} is outside the vocabulary [0, {backend.vocab_size})")
        if len(ids) >= backend.max_context:
            raise HTTPException(400, f"prompt: {len(ids)} tokens exceed the context of {backend.max_context}")
        return ids

    async def run(ids: list[int], params: SamplingParams, avoid: tuple[str, ...] = ()) -> AsyncIterator[StreamItem]:
        """Admission control, metrics and error mapping around the backend's stream."""
        if state["inflight"] >= max_inflight:
            raise HTTPException(503, f"server busy: {max_inflight} requests in flight")
        state["inflight"] += 1
        t0 = time.perf_counter()
        first = last = None
        try:
            async for item in backend.stream(ids, params, avoid):
                now = time.perf_counter()
                if item.error:
                    metrics.inc("strata_request_errors_total")
                    raise RuntimeError(item.error)
                if item.token_ids:
                    if first is None:
                        first = now
                        metrics.observe("strata_ttft_seconds", now - t0)
                    elif last is not None:
                        metrics.observe("strata_inter_token_seconds", (now - last) / len(item.token_ids))
                    last = now
                if item.finished:
                    metrics.inc("strata_requests_total")
                    for tier, n in (item.cached_tokens_by_tier or {}).items():
                        metrics.inc("strata_cache_hit_tokens_total", n, tier=tier)
                    metrics.inc("strata_prompt_tokens_total", item.prompt_tokens)
                yield item
        finally:
            state["inflight"] -= 1

    async def first_or_error(gen: AsyncIterator[StreamItem], retryable: bool = False):
        """Start the stream before answering, so admission errors become HTTP errors, not broken SSE.
        ``retryable``: let WorkerFailed through to a caller that retries."""
        try:
            item = await gen.__anext__()
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
        return item

    async def collect(ids: list[int], params: SamplingParams) -> tuple[list[int], StreamItem]:
        """A whole (non-streamed) response. Nothing was sent yet, so a request whose worker died is
        retried once, routed away from the workers that failed."""
        avoid: tuple[str, ...] = ()
        for attempt in range(2):
            try:
                gen = run(ids, params, avoid)
                item = await first_or_error(gen, retryable=True)
                toks = list(item.token_ids) if item else []
                last = item
                while last is not None and not last.finished:
                    last = await gen.__anext__()
                    toks += last.token_ids
                return toks, last
            except WorkerFailed as e:
                metrics.inc("strata_request_retries_total")
                if attempt:
                    raise HTTPException(503, f"request failed: {e}") from None
                avoid = e.workers
            except RuntimeError as e:
                raise HTTPException(503, f"request failed: {e}") from None
        raise AssertionError("unreachable")

    def sse(gen_factory) -> StreamingResponse:
        return StreamingResponse(gen_factory(), media_type="text/event-stream")

    def meta(item: StreamItem, toks: list[int]) -> dict:
        return {"prompt_tokens": item.prompt_tokens, "completion_tokens": len(toks),
                "cached_tokens": item.cached_tokens, "cached_tokens_by_tier": item.cached_tokens_by_tier,
                "finish_reason": item.finish_reason, **({"route": item.route} if item.route else {})}

    # ---- SGLang /generate -------------------------------------------------------------------------
    @app.post("/generate", response_model=GenerateResponse,
              responses={**sse_200(GenerateChunk), **errors(400, 413, 422, 503)})
    async def generate(body: GenerateRequest):
        if (body.text is None) == (body.input_ids is None):
            raise HTTPException(400, "exactly one of text or input_ids is required")
        ids = check_ids(encode(body.text, "text") if body.text is not None else list(body.input_ids))
        sp = body.sampling_params
        max_new = fit(ids, sp.max_new_tokens if "max_new_tokens" in sp.model_fields_set else None,
                      "sampling_params.max_new_tokens", sp.max_new_tokens)
        params = _params(max_new, sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.stop_token_ids,
                         sp.ignore_eos)
        if not body.stream:
            toks, last = await collect(ids, params)
            return {"text": backend.decode(toks), "output_ids": toks, "meta_info": meta(last, toks)}
        gen = run(ids, params)
        first = await first_or_error(gen)

        async def events():
            toks: list[int] = []
            item = first
            try:
                while item is not None:
                    toks += item.token_ids
                    payload = {"text": backend.decode(toks), "output_ids": list(toks),
                               "meta_info": meta(item, toks) if item.finished else
                               {"prompt_tokens": len(ids), "completion_tokens": len(toks)}}
                    yield f"data: {json.dumps(payload)}\n\n"
                    if item.finished:
                        break
                    item = await gen.__anext__()
            except Exception as e:  # a worker died mid-stream: tell the client, cleanly
                yield f"data: {json.dumps({'error': {'message': f'request failed: {e}', 'type': 'server_error'}})}\n\n"
            yield "data: [DONE]\n\n"
        return sse(events)

    # ---- OpenAI ------------------------------------------------------------------------------------
    def usage(item: StreamItem, n_out: int) -> dict:
        return {"prompt_tokens": item.prompt_tokens, "completion_tokens": n_out,
                "total_tokens": item.prompt_tokens + n_out,
                "prompt_tokens_details": {"cached_tokens": item.cached_tokens}}

    async def openai_response(kind: str, ids: list[int], params: SamplingParams, stream: bool,
                              include_usage: bool):
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        obj = "chat.completion" if kind == "chat" else "text_completion"

        def choice(text: str, reason, delta: bool):
            if kind == "chat":
                body = {"delta": {"role": "assistant", "content": text}} if delta else \
                    {"message": {"role": "assistant", "content": text}}
                return {"index": 0, **body, "finish_reason": reason, "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}

        def reason_of(item: StreamItem):
            return {"stop": "stop", "length": "length"}.get(item.finish_reason, item.finish_reason)

        if not stream:
            toks, last = await collect(ids, params)
            return {"id": rid, "object": obj, "created": created, "model": backend.model_name,
                    "choices": [choice(backend.decode(toks), reason_of(last), False)], "usage": usage(last, len(toks))}
        gen = run(ids, params)
        first = await first_or_error(gen)

        async def events():
            toks: list[int] = []
            sent = ""
            item = first
            chunk_obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
            try:
                while item is not None:
                    toks += item.token_ids
                    delta, sent = stable_delta(backend.decode(toks), sent, item.finished)
                    chunk = {"id": rid, "object": chunk_obj, "created": created, "model": backend.model_name,
                             "choices": [choice(delta, reason_of(item) if item.finished else None, True)]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                    if item.finished:
                        if include_usage:
                            yield f"data: {json.dumps({**chunk, 'choices': [], 'usage': usage(item, len(toks))})}\n\n"
                        break
                    item = await gen.__anext__()
            except Exception as e:
                yield f"data: {json.dumps({'error': {'message': f'request failed: {e}', 'type': 'server_error'}})}\n\n"
            yield "data: [DONE]\n\n"
        return sse(events)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**sse_200(CompletionChunk), **errors(400, 413, 422, 503)})
    async def completions(body: CompletionRequest):
        ids = check_ids(encode(body.prompt, "prompt") if isinstance(body.prompt, str) else list(body.prompt))
        max_new = fit(ids, body.max_tokens if "max_tokens" in body.model_fields_set else None, "max_tokens",
                      body.max_tokens)
        params = _params(max_new, body.temperature, body.top_p, -1, body.seed, None, False)
        usage_opt = bool((body.stream_options or {}).get("include_usage"))
        return await openai_response("text", ids, params, body.stream, usage_opt)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**sse_200(ChatCompletionChunk), **errors(400, 413, 422, 503)})
    async def chat(body: ChatRequest):
        prompt = backend.chat_prompt([m.model_dump(exclude_none=True) for m in body.messages])
        ids = check_ids(encode(prompt, "messages"))
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_new = fit(ids, getattr(body, field), field, 128)
        params = _params(max_new, body.temperature, body.top_p, -1, body.seed, None, False)
        usage_opt = bool((body.stream_options or {}).get("include_usage"))
        return await openai_response("chat", ids, params, body.stream, usage_opt)

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return {"object": "list", "data": [{"id": backend.model_name, "object": "model", "created": 0,
                                            "owned_by": "strata", "max_model_len": backend.max_context}]}

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health():
        h = await backend.health()
        return JSONResponse(h, status_code=200 if h.get("ok") else 503)

    @app.post("/flush_cache", response_model=FlushResult, responses={409: {"model": FlushResult}, **errors(413)})
    async def flush_cache():
        ok = await backend.flush_cache()
        return JSONResponse({"flushed": ok}, status_code=200 if ok else 409)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prom():
        return metrics.render(await backend.gauges())

    finish_openapi(app, backend.vocab_size)
    return app
