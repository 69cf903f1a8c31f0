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

from engine.strict_schema import strict_schema

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
            if c is None and calls and not m.group(0).endswith("</tool_call>"):
                # a call cut off by max_tokens after complete ones: the grammar held it to a call, so
                # it is no reply text
                kept.append(text[at:m.start()])
                at = len(text)
                break
            if c is not None:
                kept.append(text[at:m.start()])
                at = m.end()
                calls.append(c)
        tail = text[at:]
        if calls and OPEN["hermes"].startswith(tail.strip()):
            tail = ""       # the next call's tag, cut off by max_tokens
        kept.append(tail)
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


# The head of a hermes call as the tool grammar writes it (name first, arguments an object): from here on
# the arguments can be streamed as they are generated.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


class _Arguments:
    """Where a streamed arguments object ends: brackets counted outside JSON strings."""

    def __init__(self, index: int) -> None:
        self.index, self.depth, self.in_str, self.esc, self.done = index, 0, False, False, False

    def scan(self, text: str) -> int:
        """How much of ``text`` still belongs to the arguments (all of it, or up to the closing brace)."""
        for i, ch in enumerate(text):
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class ToolCallStreamer:
    """Text deltas in; content deltas and tool-call deltas out, in OpenAI's streaming shape: each call's
    first delta ``{"index", "id", "type", "function": {"name", "arguments": ""}}``, then deltas
    ``{"index", "function": {"arguments": fragment}}`` whose fragments add up to the arguments. A hermes
    call streams its arguments as they are generated; other formats (whose call is the rest of the reply)
    send them whole at the end. Text that may be the start of a call marker is held back, so a marker
    never leaks into content."""

    def __init__(self, fmt: str, tools: list[dict]) -> None:
        self.fmt, self.tools = fmt, tools
        self.names = _names(tools)
        self.buf = ""
        self.n = 0
        self.in_call = False
        self.args: _Arguments | None = None     # the hermes call whose arguments are streaming

    def _head(self, id_: str, name: str) -> dict:
        d = {"index": self.n, "id": id_, "type": "function", "function": {"name": name, "arguments": ""}}
        self.n += 1
        return d

    def _deltas(self, c: ToolCall) -> list[dict]:
        head = self._head(c.id, c.name)
        return [head, {"index": head["index"], "function": {"arguments": c.arguments}}]

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.buf += delta
        marker = OPEN[self.fmt]
        if self.fmt != "hermes":
            # a call is the whole rest of the reply: hold everything once it may have started
            if self.in_call or marker in self.buf or self.buf.lstrip().startswith(("{", "[")):
                self.in_call = True
                return "", []
            return self._flush_safe(marker), []
        out, calls = "", []
        while True:
            if not self.in_call:
                at = self.buf.find(marker)
                if at < 0:
                    return self._content(out + self._flush_safe(marker)), calls
                out += self.buf[:at]
                self.buf = self.buf[at:]
                self.in_call = True
            if self.args is None:
                head = _HEAD.match(self.buf, len(marker))
                if head and head.group(1) in self.names:
                    calls.append(self._head(f"call_{uuid.uuid4().hex[:24]}", head.group(1)))
                    self.args, self.buf = _Arguments(calls[-1]["index"]), self.buf[head.end():]
            if self.args is not None and not self.args.done:
                took = self.args.scan(self.buf)
                if took:
                    calls.append({"index": self.args.index, "function": {"arguments": self.buf[:took]}})
                    self.buf = self.buf[took:]
            end = self.buf.find("</tool_call>")
            if end < 0:
                return self._content(out), calls
            chunk, self.buf = self.buf[:end + len("</tool_call>")], self.buf[end + len("</tool_call>"):]
            self.in_call = False
            if self.args is not None:       # its arguments went out already; the rest is the closing tail
                self.args = None
                continue
            # not in the grammar's shape (a call written without the grammar): the call whole, or text
            _content, parsed = parse_tool_calls(chunk, self.fmt, self.tools)
            if parsed:
                calls += [d for c in parsed for d in self._deltas(c)]
            else:
                out += chunk

    def _content(self, text: str) -> str:
        # the newlines between and after calls separate them; they are not a reply (the whole text's
        # parse strips them too)
        return text if self.n == 0 or text.strip() else ""

    def _flush_safe(self, marker: str) -> str:
        hold = max((k for k in range(min(len(marker) - 1, len(self.buf)), 0, -1)
                    if self.buf.endswith(marker[:k])), default=0)
        out, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
        return out

    def finish(self) -> tuple[str, list[dict]]:
        rest, self.buf, self.in_call = self.buf, "", False
        if self.args is not None:   # the reply ended inside a streamed call: what it had went out already
            self.args = None
            return "", []
        content, calls = parse_tool_calls(rest, self.fmt, self.tools)
        return content, [d for c in calls for d in self._deltas(c)]


def validate_tools(tools: list[dict]) -> None:
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name: required")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters: must be a JSON schema object")


def _rebase_refs(node, base: str):
    """The arguments schema is embedded under ``base`` in the call's schema, so its local ``$ref``s (to its
    own ``$defs``, or to itself) must point below ``base`` to still mean what they meant."""
    if isinstance(node, list):
        return [_rebase_refs(n, base) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = base + v[1:]
        elif k in ("enum", "const", "default", "examples"):
            out[k] = v
        else:
            out[k] = _rebase_refs(v, base)
    return out


def _call_schema(fn: dict, args_key: str, where: str) -> dict:
    # The strict reading vLLM and SGLang constrain tool arguments with (engine/strict_schema.py): without
    # it a weak model keeps adding keys the schema never listed until it runs out of tokens.
    params = strict_schema(fn.get("parameters") or {"type": "object", "properties": {}},
                           strict=bool(fn.get("strict")), where=f"{where}.parameters")
    # compact JSON: with free whitespace a weak model pads the call until it runs out of tokens
    return {"x-guidance": {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "},
            "type": "object", "properties": {"name": {"const": fn["name"]},
                                             args_key: _rebase_refs(params, f"#/properties/{args_key}")},
            "required": ["name", args_key], "additionalProperties": False}


def _calls_rule(fmt: str, parallel: bool) -> str:
    """The rule for the calls after the format's opening text (OPEN): one call, or with ``parallel``
    one or more (OpenAI's parallel_tool_calls)."""
    if fmt == "hermes":
        one = '"\\n" call "\\n</tool_call>"'
        return f"calls: {one}" + (f' ("\\n<tool_call>" {one})*' if parallel else "")
    if fmt == "mistral":
        return 'calls: "[" call ' + ('(", " call)* ' if parallel else "") + '"]"'
    return "calls: call" + (' (";" call)*' if parallel else "")


def tool_grammar(tools: list[dict], tool_choice, fmt: str, parallel: bool = True) -> tuple[str, str] | None:
    """A Lark grammar (llguidance dialect, ``%json`` for the calls' JSON) for a request that may call
    tools: "required" forces one call of any tool, or several with ``parallel``; a named function forces
    one call of it; "auto" lets the model write free text, but once it opens a call (the format's opening
    tag; for llama3_json a reply that starts as JSON) the calls are constrained the same way and the reply
    ends after them. Every call's arguments follow the strict reading of its schema. None for "none"."""
    validate_tools(tools)
    if tool_choice in (None, "none"):
        return None
    fns = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        fns = [f for f in fns if f["name"] == name]
        if not fns:
            raise ValueError(f"tool_choice.function.name: no tool named {name!r}")
    elif tool_choice not in ("required", "auto"):
        raise ValueError(f"tool_choice: must be none, auto, required or a named function, got {tool_choice!r}")
    args_key = "parameters" if fmt == "llama3_json" else "arguments"
    index = {t["function"]["name"]: i for i, t in enumerate(tools)}
    rules = [f"call_{i}: %json {json.dumps(_call_schema(f, args_key, 'tools[%d].function' % index[f['name']]))}"
             for i, f in enumerate(fns)]
    # a named function is called exactly once (vLLM's reading; OpenAI forces "exactly one specific function")
    opener, calls = OPEN[fmt], _calls_rule(fmt, parallel and not isinstance(tool_choice, dict))
    call = "call: " + " | ".join(f"call_{i}" for i in range(len(fns)))
    if tool_choice != "auto":
        start = f"start: {json.dumps(opener)} calls" if fmt != "llama3_json" else "start: calls"
        return ("lark", "\n".join([start, calls, call, *rules]))
    if fmt == "llama3_json":
        # the whole reply is the calls, or text that does not start as a call
        head = ['start: TEXT | calls | "<|python_tag|>" calls', "TEXT: /([^{](.|\\n)*)?/"]
    else:
        # `opened` is lazy: it ends at the first opening tag, so free text can never contain one
        head = ["start: TEXT | opened calls", "TEXT: /(.|\\n)*/", f"opened[lazy]: TEXT {json.dumps(opener)}"]
    return ("lark", "\n".join(["%llguidance {}", *head, calls, call, *rules]))


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
