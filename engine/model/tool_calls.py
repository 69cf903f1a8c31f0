"""Tool calls in generated text: which format a chat template asks the model for, parsing calls back out
of the text (whole or streamed), the grammar that forces a valid call, and a system prompt describing the
tools for templates that do not render them.

Formats: ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``: Qwen, Hermes, and the
default), ``llama3_json`` (``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``)
and ``mistral`` (``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``)."""
from __future__ import annotations

import json
import re
import uuid
from typing import NamedTuple

FORMATS = ("hermes", "llama3_json", "mistral")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
OPEN = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}


class ToolCall(NamedTuple):
    id: str
    name: str
    arguments: str     # a JSON object, as text


def tool_call_format(template: str | None) -> str:
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or ('"parameters"' in t and "ipython" in t):
        return "llama3_json"
    return "hermes"


def _call(obj, names: set[str], args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], json.dumps(args, ensure_ascii=False))


def _names(tools: list[dict]) -> set[str]:
    return {t["function"]["name"] for t in tools}


def parse_tool_calls(text: str, fmt: str, tools: list[dict]) -> tuple[str, list[ToolCall]]:
    """(the text without the calls, the calls). A call naming an unknown tool or whose arguments are not
    a JSON object stays in the text."""
    names = _names(tools)
    if fmt == "hermes":
        calls, kept, at = [], [], 0
        for m in _HERMES.finditer(text):
            try:
                c = _call(json.loads(m.group(1)), names, "arguments")
            except ValueError:
                c = None
            if c is not None:
                kept.append(text[at:m.start()])
                at = m.end()
                calls.append(c)
        kept.append(text[at:])
        return "".join(kept).strip() if calls else text, calls
    if fmt == "mistral":
        head, sep, body = text.partition("[TOOL_CALLS]")
        if not sep:
            return text, []
        try:
            objs, _end = json.JSONDecoder().raw_decode(body.strip())
        except ValueError:
            return text, []
        calls = [_call(o, names, "arguments") for o in (objs if isinstance(objs, list) else [objs])]
        return (head.strip(), calls) if calls and all(calls) else (text, [])
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):]
    calls = []
    for part in body.split(";"):
        try:
            c = _call(json.loads(part), names, "parameters")
        except ValueError:
            return text, []
        if c is None:
            return text, []
        calls.append(c)
    return "", calls


class ToolCallStreamer:
    """Text deltas in; content deltas and tool-call deltas (OpenAI's streaming shape: ``{"index", "id",
    "type", "function": {"name", "arguments"}}``) out. Text that may be the start of a call marker is
    held back, so a marker never leaks into content."""

    def __init__(self, fmt: str, tools: list[dict]) -> None:
        self.fmt, self.tools = fmt, tools
        self.buf = ""
        self.n = 0
        self.in_call = False

    def _delta(self, c: ToolCall) -> dict:
        d = {"index": self.n, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        self.n += 1
        return d

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.buf += delta
        marker = OPEN[self.fmt]
        if self.fmt != "hermes":
            # a call is the whole rest of the reply: hold everything once it may have started
            if self.in_call or marker in self.buf or self.buf.lstrip().startswith(("{", "[")):
                self.in_call = True
                return "", []
            return self._flush_safe(marker)
        out, calls = "", []
        while True:
            if not self.in_call:
                at = self.buf.find(marker)
                if at < 0:
                    return out + self._flush_safe(marker), calls
                out += self.buf[:at]
                self.buf = self.buf[at:]
                self.in_call = True
            end = self.buf.find("</tool_call>")
            if end < 0:
                return out, calls
            chunk, self.buf = self.buf[:end + len("</tool_call>")], self.buf[end + len("</tool_call>"):]
            self.in_call = False
            _content, parsed = parse_tool_calls(chunk, self.fmt, self.tools)
            if parsed:
                calls += [self._delta(c) for c in parsed]
            else:
                out += chunk

    def _flush_safe(self, marker: str) -> str:
        hold = max((k for k in range(min(len(marker) - 1, len(self.buf)), 0, -1)
                    if self.buf.endswith(marker[:k])), default=0)
        out, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
        return out

    def finish(self) -> tuple[str, list[dict]]:
        rest, self.buf, self.in_call = self.buf, "", False
        content, calls = parse_tool_calls(rest, self.fmt, self.tools)
        return content, [self._delta(c) for c in calls]


def validate_tools(tools: list[dict]) -> None:
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name: required")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters: must be a JSON schema object")


def _call_schema(fn: dict, args_key: str) -> dict:
    params = fn.get("parameters") or {"type": "object"}
    # compact JSON: with free whitespace a weak model pads the call until it runs out of tokens
    return {"x-guidance": {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "},
            "type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}


def tool_grammar(tools: list[dict], tool_choice, fmt: str) -> tuple[str, str] | None:
    """A Lark grammar (llguidance dialect, ``%json`` for the JSON parts) forcing exactly one valid call
    when ``tool_choice`` is "required" (any tool) or names a function; None for "auto" / "none"."""
    validate_tools(tools)
    if tool_choice in (None, "auto", "none"):
        return None
    fns = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        fns = [f for f in fns if f["name"] == name]
        if not fns:
            raise ValueError(f"tool_choice.function.name: no tool named {name!r}")
    elif tool_choice != "required":
        raise ValueError(f"tool_choice: must be none, auto, required or a named function, got {tool_choice!r}")
    args_key = "parameters" if fmt == "llama3_json" else "arguments"
    rules = [f"call_{i}: %json {json.dumps(_call_schema(f, args_key))}" for i, f in enumerate(fns)]
    call = "call: " + " | ".join(f"call_{i}" for i in range(len(fns)))
    if fmt == "hermes":
        start = 'start: "<tool_call>\\n" call "\\n</tool_call>"'
    elif fmt == "mistral":
        start = 'start: "[TOOL_CALLS][" call "]"'
    else:
        start = "start: call"
    return ("lark", "\n".join([start, call, *rules]))


def tools_system_prompt(tools: list[dict], fmt: str) -> str:
    """For templates that do not render tools: the tools and how to call them, as a system message."""
    validate_tools(tools)
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if fmt == "hermes":
        how = 'return <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    elif fmt == "mistral":
        how = 'return [TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]'
    else:
        how = 'return {"name": <function-name>, "parameters": <args-json-object>}'
    return ("You may call one or more functions to assist with the user query. The functions are:\n"
            f"<tools>\n{listing}\n</tools>\nTo call a function, {how}")
