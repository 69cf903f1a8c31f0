"""Server-sent events and the response wrapper the adapters share: every stream ends with
``data: [DONE]``; a failure mid-stream (a worker died) is one error event before it, never a broken
connection. Fields a request carried that strata ignores are named in ``x-strata-ignored-fields``."""
from __future__ import annotations

import json
import logging
from typing import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

log = logging.getLogger("strata.http")
IGNORED_HEADER = "x-strata-ignored-fields"


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def sse(events: AsyncIterator[str]) -> StreamingResponse:
    async def framed():
        try:
            async for e in events:
                yield e
        except Exception as e:  # noqa: BLE001 - headers are sent: report it in the stream
            yield event({"error": {"message": f"request failed: {e}", "type": "server_error", "param": None,
                                   "code": 500}})
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"
    return StreamingResponse(framed(), media_type="text/event-stream")


def reply(result, body):
    """``result`` (a dict or a streaming response) with the ignored-fields header when there are any."""
    extra = sorted((getattr(body, "model_extra", None) or {}).keys())
    if not extra:
        return result
    log.warning("ignored request fields: %s", ", ".join(map(repr, extra))[:2000])
    # A header value is latin-1 without control characters: anything else in a field name becomes "?".
    value = ",".join("".join(c if c.isascii() and c.isprintable() and c != "," else "?" for c in k)
                     for k in extra)[:2000]
    if isinstance(result, StreamingResponse):
        result.headers[IGNORED_HEADER] = value
        return result
    return JSONResponse(result, headers={IGNORED_HEADER: value})
