"""The HTTP API (FastAPI), independent of how requests are served: a ``Frontend`` (actors/frontend.py)
shared by the OpenAI adapter (/v1/completions, /v1/chat/completions, /v1/models, and vLLM's /tokenize,
/detokenize) and the SGLang adapter (/generate, /get_model_info, /get_server_info), plus /health, /metrics
and /flush_cache. A ``Backend``
does the serving (the Ray ingress plugs in the cluster)."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.frontend import Backend, Frontend, ServiceUnavailable, WorkerFailed, stable_delta  # noqa: F401
from actors.http_body import DEFAULT_MAX_BODY_BYTES, BodyLimit
from actors.lifecycle import DRAINING
from actors.http_models import FlushResult, Health, errors, finish_openapi
from actors.metrics import Metrics
from actors import openai_errors as oe
from actors.openai_api import add_openai_routes
from actors.requests import UNSUPPORTED
from actors.sglang_api import add_sglang_routes
from actors.tokenize_api import add_tokenize_routes


def build_app(backend: Backend, metrics: Metrics | None = None, max_inflight: int = 256,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="strata", version="0.1.0")
    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes)
    fe = Frontend(backend, metrics, max_inflight)
    app.state.frontend = fe     # the ingress's drain() reaches it here

    @app.exception_handler(RequestValidationError)
    async def _invalid(req: Request, exc: RequestValidationError):
        errs = oe.problems(exc.errors())
        if oe.is_openai(req.url.path):
            return JSONResponse(oe.validation_error(errs), status_code=400)
        # SGLang's routes: a known field strata cannot honour at the value sent is a 400 naming it; a
        # malformed one 422, as SGLang answers.
        unsupported = errs and all(UNSUPPORTED in (e["msg"] or "") for e in errs)
        msg = "; ".join(f"{e['field']}: {e['msg']}" for e in errs[:5]) if unsupported else "invalid request"
        status = 400 if unsupported else 422
        out = oe.body(msg, status, errs[0]["field"] if errs else None)
        out["error"]["details"] = errs
        return JSONResponse(out, status_code=status)

    # Starlette's own HTTPException too (a body that is not UTF-8 JSON, 404, 405): one error shape,
    # OpenAI's ({"error": {"message", "type", "param", "code"}}).
    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException):
        d = exc.detail if isinstance(exc.detail, dict) else {"message": str(exc.detail)}
        return JSONResponse(oe.body(d["message"], exc.status_code, d.get("param"), d.get("code")),
                            status_code=exc.status_code)

    add_sglang_routes(app, fe)
    add_openai_routes(app, fe)
    add_tokenize_routes(app, fe)

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health():
        if fe.draining:
            return JSONResponse(DRAINING, status_code=503)
        h = await backend.health()
        return JSONResponse({**h, "status": "ready" if h.get("ok") else "unhealthy"},
                            status_code=200 if h.get("ok") else 503)

    @app.post("/flush_cache", response_model=FlushResult, responses={409: {"model": FlushResult}, **errors(413)})
    async def flush_cache():
        res = await backend.flush_cache()
        return JSONResponse(res, status_code=200 if res["flushed"] else 409)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prom():
        return fe.metrics.render(await backend.gauges())

    finish_openapi(app, backend.vocab_size)
    return app
