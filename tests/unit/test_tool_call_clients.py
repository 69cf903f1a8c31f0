"""Tool calls as the clients that found issue 34 see them: the official ``openai`` SDK, LangChain
(``langchain-openai``) and LiteLLM, each talking HTTP to the frontend over one in-process engine served by
uvicorn on a loopback port. The model is the seeded random strata-tiny, so whatever it writes is garbage:
the grammar alone must make every call valid, with exactly the keys the schema lists, and end it well
within max_tokens (the bug: ``add(a, b)`` with max_tokens 300 ran to ``length`` adding keys)."""
import json
import os
import threading
import time

import openai
import pytest
import uvicorn

from actors.http_api import build_app
from actors.local_backend import LocalBackend
from tests.util import free_port

MODEL = "strata-tiny"
# LangChain's shape for `def add(a: int, b: int)`: no "additionalProperties" anywhere, as most users write.
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
MUL = {"type": "function", "function": {"name": "mul", "description": "Multiply two integers.", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}}}
MSGS = [{"role": "user", "content": "What is 2 + 3? Use the tool."}]
KEYS = {"add": {"a", "b"}, "mul": {"x", "y"}}


@pytest.fixture(scope="module")
def base_url():
    backend = LocalBackend.from_pretrained(MODEL, page_size=16, num_pages=512, enable_prefix_cache=True)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(backend), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(30)
    backend.close()


@pytest.fixture(scope="module")
def oai(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def _valid(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    assert set(args) == KEYS[name], args
    assert all(isinstance(v, int) for v in args.values()), args
    return args


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_openai_named_call_without_additional_properties_ends_as_a_call(oai, seed):
    r = oai.chat.completions.create(model=MODEL, messages=MSGS, tools=[ADD], max_tokens=300, temperature=1.0,
                                    seed=seed, tool_choice={"type": "function", "function": {"name": "add"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", (c.finish_reason, c.message.content)
    assert len(c.message.tool_calls) == 1 and c.message.tool_calls[0].function.name == "add"
    _valid("add", c.message.tool_calls[0].function.arguments)
    assert r.usage.completion_tokens < 150


def _streamed_calls(stream) -> tuple[list[tuple[str, str]], str]:
    """((name, arguments) per call, finish_reason) from a chat stream, checking OpenAI's delta shape."""
    deltas, finish = [], None
    for chunk in stream:
        for ch in chunk.choices:
            assert len(ch.delta.tool_calls or []) <= 1     # one call's delta per chunk, as OpenAI sends them
            deltas += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    by_index: dict[int, list] = {}
    for d in deltas:
        by_index.setdefault(d.index, []).append(d)
    assert sorted(by_index) == list(range(len(by_index)))
    calls = []
    for parts in by_index.values():
        head, rest = parts[0], parts[1:]
        # OpenAI's shape: the head names the call with empty arguments; the fragments carry no id or name.
        assert head.id and head.type == "function" and head.function.name in KEYS and head.function.arguments == ""
        assert rest and all(p.id is None and p.function.name is None for p in rest)
        calls.append((head.function.name, "".join(p.function.arguments for p in rest)))
    return calls, finish


def test_openai_streams_argument_deltas_as_openai_does(oai):
    s = oai.chat.completions.create(model=MODEL, messages=MSGS, tools=[ADD, MUL], max_tokens=300, temperature=1.0,
                                    seed=5, stream=True, tool_choice={"type": "function", "function": {"name": "mul"}})
    calls, finish = _streamed_calls(s)
    assert finish == "tool_calls" and len(calls) == 1 and calls[0][0] == "mul"
    _valid(*calls[0])


def test_parallel_tool_calls_true_allows_several_calls(oai):
    """With parallel_tool_calls (OpenAI's default) the model decides how many calls: strata-tiny rarely
    picks end-of-text after one, so it writes calls until max_tokens. Every complete call is valid; the
    one max_tokens cut is left out of the message (it was streamed as far as it got)."""
    r = oai.chat.completions.create(model=MODEL, messages=MSGS, tools=[ADD, MUL], tool_choice="required",
                                    max_tokens=300, temperature=1.0, seed=1)
    c = r.choices[0]
    assert len(c.message.tool_calls) > 1 and not c.message.content
    for call in c.message.tool_calls:
        _valid(call.function.name, call.function.arguments)
    assert c.finish_reason == "tool_calls" or r.usage.completion_tokens == 300
    s = oai.chat.completions.create(model=MODEL, messages=MSGS, tools=[ADD, MUL], tool_choice="required",
                                    max_tokens=300, temperature=1.0, seed=1, stream=True)
    calls, finish = _streamed_calls(s)
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == calls[:len(c.message.tool_calls)]
    assert finish == c.finish_reason


def test_openai_nested_schemas_are_strict_where_they_say_nothing(oai):
    """Nested objects, arrays of objects, anyOf branches and $defs get no keys they do not list; an
    explicit ``additionalProperties: true`` still lets the model add keys."""
    point = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
             "required": ["x", "y"]}
    tool = {"type": "function", "function": {"name": "draw", "parameters": {
        "type": "object", "$defs": {"Point": point},
        "properties": {"at": {"$ref": "#/$defs/Point"},
                       "path": {"type": "array", "items": point, "maxItems": 2},
                       "style": {"anyOf": [{"type": "object", "properties": {"color": {"enum": ["red", "blue"]}},
                                            "required": ["color"]}, {"type": "null"}]}},
        "required": ["at", "path", "style"]}}}
    r = oai.chat.completions.create(model=MODEL, messages=MSGS, tools=[tool], tool_choice="required",
                                    max_tokens=400, temperature=1.0, seed=7, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message.content
    args = json.loads(c.message.tool_calls[0].function.arguments)
    assert set(args) == {"at", "path", "style"} and set(args["at"]) == {"x", "y"}
    assert all(set(p) == {"x", "y"} for p in args["path"])
    assert args["style"] is None or set(args["style"]) == {"color"}


def test_bad_tool_schemas_are_400s_naming_the_tool(oai):
    strict_open = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MSGS, tools=[strict_open], tool_choice="required")
    assert "tools[0]" in e.value.message and "additionalProperties" in e.value.message
    broken = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MSGS, tools=[broken], tool_choice="required")
    assert "tools" in e.value.message
    # auto had no grammar before: a schema the grammar cannot use leaves it unconstrained, not refused
    r = oai.chat.completions.create(model=MODEL, messages=MSGS, tools=[broken], max_tokens=4)
    assert r.choices[0].finish_reason == "length"


# ---- LangChain ---------------------------------------------------------------------------------------
langchain_openai = pytest.importorskip("langchain_openai")


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture(scope="module")
def chat(base_url):
    def make(seed: int):
        return langchain_openai.ChatOpenAI(model=MODEL, base_url=base_url, api_key="unused", max_tokens=300,
                                           temperature=1.0, seed=seed, max_retries=0)
    return make


@pytest.mark.parametrize("choice,kw", [("add", {}), ("any", {"parallel_tool_calls": False})])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_langchain_bind_tools_named_and_any_get_one_valid_call(chat, choice, kw, seed):
    msg = chat(seed).bind_tools([add], tool_choice=choice, **kw).invoke("What is 2 + 3?")
    assert msg.response_metadata["finish_reason"] == "tool_calls", msg.content
    assert not msg.invalid_tool_calls and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"}
    assert add(**call["args"]) == call["args"]["a"] + call["args"]["b"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_langchain_bind_tools_any_with_parallel_calls_gets_only_valid_calls(chat, seed):
    msg = chat(seed).bind_tools([add], tool_choice="any").invoke("What is 2 + 3?")
    assert not msg.invalid_tool_calls and msg.tool_calls and not msg.content
    assert all(c["name"] == "add" and set(c["args"]) == {"a", "b"} for c in msg.tool_calls)
    # the model chose how many calls (see test_parallel_tool_calls_true_allows_several_calls)
    assert msg.response_metadata["finish_reason"] == "tool_calls" or msg.usage_metadata["output_tokens"] == 300


def test_langchain_streamed_tool_call_chunks_merge_into_one_valid_call(chat):
    merged = None
    for chunk in chat(1).bind_tools([add], tool_choice="add").stream("What is 2 + 3?"):
        merged = chunk if merged is None else merged + chunk
    assert merged.response_metadata["finish_reason"] == "tool_calls"
    assert not merged.invalid_tool_calls and len(merged.tool_calls) == 1
    assert set(merged.tool_calls[0]["args"]) == {"a", "b"}


def test_langchain_auto_keeps_free_text(chat):
    """auto now runs under a grammar too: it must still let the model answer in text (strata-tiny never
    writes the opening tag by itself, so what follows the tag is checked in tests/unit/test_tool_grammar.py)."""
    for seed in (0, 1):
        msg = chat(seed).bind_tools([add], tool_choice="auto").invoke("What is 2 + 3?")
        assert msg.content and not msg.tool_calls and not msg.invalid_tool_calls
        assert msg.response_metadata["finish_reason"] in ("stop", "length")


def test_langchain_with_structured_output_function_calling(chat):
    from typing import Literal

    from pydantic import BaseModel

    class Weather(BaseModel):
        """The weather in a city."""
        # no free strings: strata-tiny ends a string only when it happens to sample a quote, and no
        # grammar that honours {"type": "string"} can make it end sooner
        city: Literal["Oslo", "Lima"]
        celsius: int
        raining: bool

    for seed in (0, 1, 2):
        out = chat(seed).with_structured_output(Weather, method="function_calling", include_raw=True).invoke(
            "Weather in Oslo?")
        assert isinstance(out["parsed"], Weather) and out["parsing_error"] is None, out
        assert out["raw"].response_metadata["finish_reason"] == "tool_calls"


# ---- LiteLLM -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no download of the cost map on import
    return pytest.importorskip("litellm")


@pytest.mark.parametrize("stream", [False, True])
def test_litellm_tool_call_as_a_user_calls_it(litellm, base_url, stream):
    kw = dict(model=f"openai/{MODEL}", api_base=base_url, api_key="unused", messages=MSGS, tools=[ADD],
              tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=300, temperature=1.0,
              seed=0, num_retries=0)
    if stream:
        chunks = list(litellm.completion(stream=True, **kw))
        r = litellm.stream_chunk_builder(chunks, messages=MSGS)
    else:
        r = litellm.completion(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message.content
    assert len(c.message.tool_calls) == 1 and c.message.tool_calls[0].function.name == "add"
    _valid("add", c.message.tool_calls[0].function.arguments)
