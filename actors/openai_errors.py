"""OpenAI's error object on the OpenAI routes (/v1/..., and vLLM's /tokenize, /detokenize).

Every request error there has one shape, ``{"error": {"message", "type", "param", "code"}}``: the message
names the field and the problem, ``param`` is the field. A body that is not JSON, misses a field, has a
value of the wrong type or out of range is a 400, as OpenAI and vLLM answer it (FastAPI's own answer is
422): client code that catches ``openai.BadRequestError`` then sees every bad request. SGLang's routes
(/generate) keep SGLang's statuses (422 for a malformed body, as SGLang's FastAPI answers), in the same
shape plus ``details``."""
from __future__ import annotations

import json
import re

OPENAI_PATHS = ("/v1/", "/tokenize", "/detokenize")


def is_openai(path: str) -> bool:
    return path.startswith(OPENAI_PATHS)


_FIELD = re.compile(r"([A-Za-z_][\w.\[\]]*): ")


def body(message: str, status: int, param: str | None = None, code: int | str | None = None) -> dict:
    """The error object: ``type`` as OpenAI spells it, ``code`` a string OpenAI names (model_not_found)
    or else the HTTP status, as vLLM sends it. Without ``param``, a 400's message that starts with a
    field ("temperature: must be ...", strata's way of naming it, the engine's ValueErrors included)
    gives it; "request: " only says the whole sampling request, so the field after it counts."""
    if param is None and status == 400:
        m = _FIELD.match(message)
        if m and m.group(1) == "request":
            m = _FIELD.match(message, m.end())
        param = m.group(1) if m else None
    return {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                      "param": param, "code": status if code is None else code}}


def field_name(loc) -> str:
    """A pydantic error location as the field a client wrote (``messages.0.role``)."""
    parts = [str(x) for x in loc[1:]]
    # pydantic names the union member it tried ("str", "list[int]", "function-after[...]"): not a field
    return ".".join(p for p in parts if not (p[:1].islower() and ("[" in p or p in ("str", "int", "float", "bool"))))


def problems(errors) -> list[dict]:
    """FastAPI's validation errors as [{"field", "msg"}], the field "body" for the body as a whole."""
    out = []
    for e in errors:
        msg = str(e.get("msg") or "").removeprefix("Value error, ")
        if e.get("type") == "json_invalid":
            field, msg = "body", f"not valid JSON ({(e.get('ctx') or {}).get('error', msg)})"
        else:
            field = field_name(e.get("loc", ())) or "body"
            msg = msg.removeprefix(f"{field}: ")   # a validator of ours names the field itself
        p = {"field": field, "msg": msg}
        if p not in out:    # a union field repeats one complaint per member it tried
            out.append(p)
    return out


def validation_error(errs: list[dict]) -> dict:
    """A 400 naming every problem (the first five) and the first field as ``param``."""
    msg = "; ".join(f"{e['field']}: {e['msg']}" for e in errs[:5]) or "invalid request"
    param = errs[0]["field"] if errs and errs[0]["field"] != "body" else None
    return body(msg, 400, param)


def drop_default_422(doc: dict) -> None:
    """FastAPI declares a 422 on every route with a body; the OpenAI routes never answer it."""
    for path, ops in doc.get("paths", {}).items():
        if is_openai(path):
            for op in ops.values():
                if isinstance(op, dict):
                    op.get("responses", {}).pop("422", None)
    schemas = doc.get("components", {}).get("schemas", {})
    if "HTTPValidationError" in schemas and '"#/components/schemas/HTTPValidationError"' not in _dump(doc):
        schemas.pop("HTTPValidationError", None)
        if '"#/components/schemas/ValidationError"' not in _dump(doc):
            schemas.pop("ValidationError", None)


def _dump(doc: dict) -> str:
    return json.dumps(doc)
