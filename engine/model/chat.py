"""Chat templates, rendered as transformers' ``apply_chat_template`` renders them: a sandboxed jinja2
environment with trim_blocks / lstrip_blocks and loop controls, transformers' ``tojson``,
``raise_exception`` and ``strftime_now``, the special tokens of tokenizer_config.json as variables.

Messages come as OpenAI sends them. Content given as a list of text parts is joined into one string
(with newlines, as vLLM does for text-only templates); assistant tool calls get their JSON ``arguments``
as objects, which templates index into."""
from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

FALLBACK_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
                    "{% if add_generation_prompt %}assistant: {% endif %}"


def _raise(msg: str):
    raise jinja2.exceptions.TemplateError(msg)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"chat_template: {e}") from None


def normalize_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages -> what templates read: string content, tool-call arguments as objects."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in ("text", "input_text") or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}")
                texts.append(part["text"])
            m["content"] = "\n".join(texts)
        elif content is None:
            m["content"] = ""
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                c = dict(c)
                fn = dict(c.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except ValueError:
                        pass   # not JSON: the template gets the text as sent
                c["function"] = fn
                calls.append(c)
            m["tool_calls"] = calls
        out.append(m)
    return out


def render_chat(template: str | None, messages: list[dict], *, tools: list[dict] | None = None,
                add_generation_prompt: bool = True, special: dict[str, str] | None = None, **kwargs) -> str:
    """The prompt text of ``messages`` under ``template`` (None: a plain role-prefixed fallback).
    ValueError("messages: ...") when the template refuses them (its raise_exception) or fails."""
    tpl = _compile(template or FALLBACK_TEMPLATE)
    variables = {**(special or {}), **kwargs}
    try:
        return tpl.render(messages=normalize_messages(messages), tools=tools,
                          add_generation_prompt=add_generation_prompt, **variables)
    except ValueError:
        raise
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"messages: {e}") from None
    except (TypeError, KeyError, AttributeError, IndexError) as e:
        raise ValueError(f"messages: the chat template failed on them ({type(e).__name__}: {e})") from None


MESSAGE_ENDS_LOOKBACK = 4
"""How many of the last messages' ends ``message_ends`` looks for: earlier ones were the ends of earlier
turns' prompts, whose requests marked them already (and each render costs a template pass)."""


def message_ends(template: str | None, messages: list[dict], prompt: str, *, tools: list[dict] | None = None,
                 special: dict[str, str] | None = None, **kwargs) -> tuple[int, ...]:
    """Character offsets in ``prompt`` (the render of all ``messages``) where one of the last messages
    ends: the render of the messages up to it, without a generation prompt, when that is a prefix of
    ``prompt``. A template that renders a message differently once others follow it, or refuses a
    partial conversation, gives fewer offsets, never wrong ones."""
    out = []
    for i in range(max(1, len(messages) - MESSAGE_ENDS_LOOKBACK), len(messages)):
        try:
            part = render_chat(template, messages[:i], tools=tools, add_generation_prompt=False,
                               special=special, **kwargs)
        except ValueError:
            continue
        if part and len(part) < len(prompt) and prompt.startswith(part):
            out.append(len(part))
    return tuple(out)
