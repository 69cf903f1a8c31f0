"""The response shapes of the HTTP API (actors/http_api.py), declared so the OpenAPI schema states what
every endpoint returns, errors included: clients and schema-driven tests (schemathesis) can then check
each response against it, and FastAPI checks every JSON body it returns before sending it."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

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
    """OpenAI's error object (actors/openai_errors.py): ``param`` the field at fault (or null), ``code``
    a string OpenAI names (``model_not_found``) or the HTTP status; ``details`` on SGLang's 422 only."""
    message: str
    type: str
    param: Optional[str]
    code: Optional[Union[int, str]]
    details: Optional[list[ErrorDetail]] = None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body: 400 bad request (on the OpenAI routes every request error: a malformed body, a
    missing field, a value out of range), 404 unknown model, 413 body too large, 422 malformed body on
    SGLang's routes, 503 busy or down."""
    error: ErrorBody


class Route(BaseModel):
    prefill: Optional[str] = None
    decode: Optional[str] = None


class FinishReason(BaseModel):
    """SGLang's: {"type": "stop", "matched": <token id or stop string>} | {"type": "length", "length": n}
    | {"type": "abort", "message": ...}."""
    type: str
    matched: Optional[Union[int, str]] = None
    length: Optional[int] = None
    message: Optional[str] = None


LogprobTriple = list[Optional[Union[float, int, str]]]      # SGLang's [logprob, token_id, text | null]


class MetaInfo(BaseModel):
    """SGLang's meta_info, on the response and on every streamed chunk (finish_reason null until the
    last); the logprob arrays only when return_logprob asked for them."""
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: Optional[FinishReason] = None
    e2e_latency: Optional[float] = None
    cached_tokens_by_tier: Optional[dict[str, int]] = None
    cached_tokens_details: Optional[dict[str, Union[int, str]]] = None   # SGLang's: device, host, storage
    route: Optional[Route] = None
    input_token_logprobs: Optional[list[LogprobTriple]] = None
    output_token_logprobs: Optional[list[LogprobTriple]] = None
    input_top_logprobs: Optional[list[Optional[list[LogprobTriple]]]] = None
    output_top_logprobs: Optional[list[Optional[list[LogprobTriple]]]] = None


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: Optional[int] = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Optional[str] = None
    logprobs: Optional[CompletionLogprobs] = None
    stop_reason: Optional[Union[int, str]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ToolCallFunction(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class ToolCall(BaseModel):
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: ToolCallFunction


class StreamToolCall(ToolCall):
    index: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None
    refusal: Optional[list[TokenLogprob]] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: Optional[str] = None
    refusal: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Optional[str] = None
    logprobs: Optional[ChatLogprobs] = None
    stop_reason: Optional[Union[int, str]] = None


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
    root: Optional[str] = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    ok: bool
    status: Optional[str] = None     # starting | ready | unhealthy | draining
    workers: Optional[list[str]] = None
    indexed_pages: Optional[int] = None
    error: Optional[str] = None


class TokenizeResponse(BaseModel):
    """vLLM's: the prompt's token ids, their count, the served context and, when asked, each id's
    vocabulary entry."""
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeResponse(BaseModel):
    prompt: str


class FlushResult(BaseModel):
    """What /flush_cache did (actors/flush.py): all workers or none. ``workers``: per worker, pages dropped
    per tier (L1, L2; L3: pages its tree knew the store held) and component; ``L3_store``: what the clear
    of the shared store removed and its scope; ``busy``: why each busy worker could not flush (409)."""
    flushed: bool
    reason: Optional[str] = None
    busy: Optional[dict[str, str]] = None
    workers: Optional[dict[str, dict]] = None
    L3_store: Optional[dict] = None
    router: Optional[dict] = None


class GenerateChunk(BaseModel):
    """A streamed /generate event: the text and output ids so far, and meta_info as SGLang sends it
    (``index`` names the prompt/sample of a batch or n > 1)."""
    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: Optional[int] = None


class ModelInfo(BaseModel):
    model_path: str
    tokenizer_path: Optional[str] = None
    is_generation: bool
    served_model_name: str
    max_context_length: int


class InternalState(BaseModel):
    last_gen_throughput: float
    avg_spec_accept_length: Optional[float] = None
    step_time_dict: dict[str, float]


class ServerInfo(BaseModel):
    """SGLang's /get_server_info: the server settings its tooling reads (page_size, the hierarchical
    cache's), ``internal_states`` and the version."""
    model_path: str
    served_model_name: str
    page_size: int
    context_length: int
    enable_hierarchical_cache: bool
    internal_states: list[InternalState]
    version: str


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[StreamToolCall]] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: Optional[str] = None
    logprobs: Optional[ChatLogprobs] = None
    stop_reason: Optional[Union[int, str]] = None


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

    from actors.openai_errors import drop_default_422

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
            if "DetokenizeRequest" in comps:   # any ids in the vocabulary, none at all included
                comps["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] = vocab_size - 1
            drop_default_422(doc)
            for m in STREAM_MODELS:
                js = m.model_json_schema(ref_template=_REF)
                comps.update(js.pop("$defs", {}))
                comps[m.__name__] = js
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
