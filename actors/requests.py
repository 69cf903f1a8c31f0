"""The typed requests of the HTTP API: OpenAI's /v1/completions and /v1/chat/completions (with the extra
sampling fields vLLM and SGLang accept there) and SGLang's native /generate.

What each server does with a field it does not know is what strata does: the OpenAI endpoints ignore it
(vLLM and SGLang both do; strata names it in the ``x-strata-ignored-fields`` response header), SGLang's
``sampling_params`` refuses it. A known field strata cannot honour is accepted at its neutral value and
anything else is a 400 naming it (``unsupported``)."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

UNSUPPORTED = "not supported by strata"
MAX_TOKENS = 1 << 20
Seed = Optional[Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]]


def unsupported(typ, value):
    """A field strata accepts at its neutral ``value`` only (400 otherwise). Not ``Literal``: that
    compares with ==, so it would take 0 for False and False for 0."""
    def check(v):
        if v != value and not (value is None and v in ("", [], {})):
            raise ValueError(f"{UNSUPPORTED}: only {value!r} is accepted")
        return v
    return Annotated[typ, Field(json_schema_extra={"const": value}), AfterValidator(check)]


class _Strict(BaseModel):
    # strict: a JSON value of the wrong type is refused ("5" for an int, true for a token id), never
    # coerced into something the client did not send.
    model_config = ConfigDict(extra="forbid", strict=True)


class _Open(BaseModel):
    """An OpenAI-style body: unknown fields are kept aside (``model_extra``) and reported, not refused."""
    model_config = ConfigDict(extra="allow", strict=True)


Stop = Optional[Union[str, list[str]]]
LogitBias = Optional[dict[str, Annotated[float, Field(ge=-100, le=100)]]]


class _Sampling(_Open):
    """The sampling fields OpenAI, vLLM and SGLang share (names as OpenAI/vLLM spell them)."""
    temperature: Optional[float] = Field(None, ge=0.0, le=100.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0, le=2.0)
    logit_bias: LogitBias = None
    seed: Seed = None
    stop: Stop = None
    stop_token_ids: Optional[list[Annotated[int, Field(ge=0)]]] = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    no_stop_trim: bool = False               # SGLang's name for include_stop_str_in_output
    n: int = Field(1, ge=1, le=16)
    best_of: Optional[int] = Field(None, ge=1, le=16)
    use_beam_search: unsupported(bool, False) = False
    length_penalty: unsupported(float, 1.0) = 1.0
    # Structured output, vLLM's spellings (OpenAI's response_format and SGLang's regex/ebnf below).
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    json_schema: Optional[str] = None
    structural_tag: unsupported(Optional[str], None) = None
    user: Optional[str] = None
    request_id: Optional[str] = None
    priority: unsupported(int, 0) = 0
    lora_path: Optional[str] = None
    cache_salt: unsupported(Optional[str], None) = None
    kv_transfer_params: unsupported(Optional[dict], None) = None
    return_tokens_as_token_ids: bool = False
    return_cached_tokens_details: bool = False   # SGLang's: the hit by tier in the response's ``sglext``
    truncate_prompt_tokens: Optional[int] = Field(None, ge=1)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None


class StreamOptions(_Open):
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None


_Sampling.model_rebuild()


class CompletionRequest(_Sampling):
    model: Optional[str] = None
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=0, le=MAX_TOKENS)
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=20)
    suffix: unsupported(Optional[str], None) = None
    add_special_tokens: bool = False
    response_format: Optional[ResponseFormat] = None


class ContentPart(_Open):
    type: str
    text: Optional[str] = None


class ToolCallFunction(_Open):
    name: str
    arguments: str = "{}"


class MessageToolCall(_Open):
    id: Optional[str] = None
    type: str = "function"
    function: ToolCallFunction


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[MessageToolCall]] = None
    tool_call_id: Optional[str] = None


class FunctionDef(_Open):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Open):
    name: str


class NamedToolChoice(_Open):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Open):
    name: str = "response"
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None
    description: Optional[str] = None


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


CompletionRequest.model_rebuild()


class ChatRequest(_Sampling):
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=0, le=MAX_TOKENS)
    max_completion_tokens: Optional[int] = Field(None, ge=0, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[Literal["minimal", "low", "medium", "high"]] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    modalities: unsupported(Optional[list[str]], None) = None
    audio: unsupported(Optional[dict], None) = None
    prediction: unsupported(Optional[dict], None) = None
    web_search_options: unsupported(Optional[dict], None) = None
    functions: unsupported(Optional[list[dict]], None) = None
    function_call: unsupported(Optional[Union[str, dict]], None) = None

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, v):
        if not any(m.content or m.tool_calls for m in v):
            raise ValueError("messages: every message is empty")
        return v


class TokenizeRequest(_Open):
    """vLLM's /tokenize: a ``prompt`` (as /v1/completions takes it) or ``messages`` (rendered as
    /v1/chat/completions renders them, with its template fields), exactly one of them.
    ``add_special_tokens`` defaults as in vLLM: true for a prompt, false for messages (the template
    writes them)."""
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[Tool]] = None
    return_token_strs: Optional[bool] = False


class DetokenizeRequest(_Open):
    """vLLM's /detokenize: token ids back to text."""
    model: Optional[str] = None
    tokens: list[Annotated[int, Field(ge=0)]]


class SGLSampling(_Strict):
    """SGLang's ``sampling_params`` (python/sglang/srt/sampling/sampling_params.py): unknown keys are an
    error there too."""
    max_new_tokens: int = Field(128, ge=0, le=MAX_TOKENS)
    min_new_tokens: int = Field(0, ge=0, le=MAX_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    logit_bias: LogitBias = None
    seed: Seed = None
    sampling_seed: Seed = None
    stop: Stop = None
    stop_token_ids: Optional[list[Annotated[int, Field(ge=0)]]] = None
    stop_regex: unsupported(Optional[Union[str, list[str]]], None) = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = Field(1, ge=1, le=16)
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: unsupported(Optional[str], None) = None
    stream_interval: Optional[int] = Field(None, ge=1)
    custom_params: unsupported(Optional[dict], None) = None


class GenerateRequest(_Open):
    """SGLang's GenerateReqInput: one request, or a batch when ``text`` / ``input_ids`` is a list of
    prompts (per-prompt ``sampling_params`` / ``rid`` may then be lists too)."""
    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[SGLSampling, list[SGLSampling]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    rid: Optional[Union[str, list[str]]] = None
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)
    top_logprobs_num: int = Field(0, ge=0, le=20)
    return_text_in_logprobs: bool = False
    lora_path: Optional[str] = None
    image_data: unsupported(Optional[Any], None) = None
    video_data: unsupported(Optional[Any], None) = None
    audio_data: unsupported(Optional[Any], None) = None
    input_embeds: unsupported(Optional[Any], None) = None
    return_hidden_states: unsupported(bool, False) = False
    session_params: unsupported(Optional[dict], None) = None
    custom_logit_processor: unsupported(Optional[str], None) = None
    token_ids_logprob: unsupported(Optional[Any], None) = None
    log_metrics: bool = True
    priority: Optional[int] = None
