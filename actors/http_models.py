"""The response shapes of the HTTP API (actors/http_api.py), declared so the OpenAPI schema states what
every endpoint returns, errors included: clients and schema-driven tests (schemathesis) can then check
each response against it, and FastAPI checks every JSON body it returns before sending it."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel as _PydanticModel
from pydantic import ConfigDict


class BaseModel(_PydanticModel):
    # FastAPI serializes a response through its model: fields not declared here (added to a response by
    # another part of strata) must pass through, not silently disappear.
    model_config = ConfigDict(extra="allow")


class ErrorDetail(BaseModel):
    field: str
    msg: str


class ErrorBody(BaseModel):
    message: str
    type: str
    code: Optional[int] = None
    details: Optional[list[ErrorDetail]] = None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body: 400 bad value, 413 body too large, 422 invalid field, 409/503 busy or down."""
    error: ErrorBody


class Route(BaseModel):
    prefill: Optional[str] = None
    decode: Optional[str] = None


class MetaInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    finish_reason: Optional[str] = None
    route: Optional[Route] = None


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Optional[str] = None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Optional[str] = None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    ok: bool
    workers: Optional[list[str]] = None
    indexed_pages: Optional[int] = None
    error: Optional[str] = None


class FlushResult(BaseModel):
    flushed: bool


class StreamMetaInfo(BaseModel):
    """meta_info of a streamed /generate event: counts on every event, the rest on the last."""
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: Optional[int] = None
    cached_tokens_by_tier: Optional[dict[str, int]] = None
    finish_reason: Optional[str] = None
    route: Optional[Route] = None


class GenerateChunk(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: StreamMetaInfo


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ChatDelta(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: Optional[str] = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


STREAM_MODELS = (GenerateChunk, CompletionChunk, ChatCompletionChunk, ErrorResponse)
_REF = "#/components/schemas/{model}"


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` entry declaring ``codes`` as ErrorResponse bodies."""
    return {c: {"model": ErrorResponse} for c in codes}


def sse_200(chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A streamed request (``"stream": true``) answers 200 with server-sent events instead of the JSON
    body: ``data: <chunk>`` events, then ``data: [DONE]``; a failure mid-stream sends one
    ``data: <ErrorResponse>`` event before ``[DONE]``. Each event's data is declared (OpenAPI 3.1:
    ``schema`` describes one event; ``contentSchema`` its JSON payload)."""
    payload = {"anyOf": [{"$ref": _REF.format(model=chunk.__name__)},
                         {"$ref": _REF.format(model=ErrorResponse.__name__)}]}
    event = {"type": "object", "required": ["data"],
             "properties": {"data": {"anyOf": [{"type": "string", "const": "[DONE]"},
                                               {"type": "string", "contentMediaType": "application/json",
                                                "contentSchema": payload}]}}}
    return {200: {"content": {"text/event-stream": {"schema": event}},
                  "description": "JSON body, or server-sent events when the request asks for stream"}}


def finish_openapi(app, vocab_size: int) -> None:
    """Complete the app's OpenAPI document with what the route declarations cannot say: the SSE chunk
    models (referenced only from ``sse_200``) as components, and the served model's vocabulary as the
    bounds of every prompt token id (the server checks them itself and answers 400 naming the id)."""
    from fastapi.openapi.utils import get_openapi

    def token_arrays(node) -> None:
        if isinstance(node, dict):
            if node.get("type") == "array" and node.get("items", {}).get("type") == "integer":
                node["items"].update(minimum=0, maximum=vocab_size - 1)
                node["minItems"] = 1  # an empty prompt is refused (400)
            elif node.get("type") == "string":
                node["minLength"] = 1
            for v in node.values():
                token_arrays(v)
        elif isinstance(node, list):
            for v in node:
                token_arrays(v)

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            comps = doc.setdefault("components", {}).setdefault("schemas", {})
            for name, fields in (("GenerateRequest", ("input_ids", "text")), ("CompletionRequest", ("prompt",))):
                for f in fields:
                    if name in comps:
                        token_arrays(comps[name]["properties"][f])
            for m in STREAM_MODELS:
                js = m.model_json_schema(ref_template=_REF)
                comps.update(js.pop("$defs", {}))
                comps[m.__name__] = js
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
