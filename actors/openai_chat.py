"""What a chat request becomes before sampling: the prompt rendered by the checkpoint's chat template
(or the request's own ``chat_template``), the tools it may call, the grammar that holds the calls to
their schemas (and forces one when ``tool_choice`` asks for one), and how the generated text is read
back into ``tool_calls``."""
from __future__ import annotations

from dataclasses import dataclass

from fastapi import HTTPException

from actors.frontend import bad
from actors.requests import ChatRequest
from engine.grammar_compile import available as grammar_available, compile_grammar
from engine.model import tool_calls as tc
from engine.model.chat import message_ends, render_chat


@dataclass(frozen=True)
class ChatPlan:
    prompt: str
    tools: tuple = ()               # the tools (as dicts) whose calls are parsed; () when none may be called
    fmt: str = "hermes"
    grammar: tuple[str, str] | None = None
    parallel: bool = True
    message_ends: tuple[int, ...] = ()   # character offsets in ``prompt`` where messages end (chat.message_ends)

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """(content, tool calls in OpenAI's message shape)."""
        if not self.tools:
            return text, []
        content, calls = tc.parse_tool_calls(text, self.fmt, list(self.tools))
        if not self.parallel:
            calls = calls[:1]
        return content, [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                         for c in calls]

    def streamer(self) -> "_Streamer":
        return _Streamer(self)


class _Streamer:
    """Content and tool-call deltas from text deltas (plain pass-through when no tool may be called)."""

    def __init__(self, plan: ChatPlan) -> None:
        self.inner = tc.ToolCallStreamer(plan.fmt, list(plan.tools)) if plan.tools else None
        self.parallel = plan.parallel

    def _keep(self, calls: list[dict]) -> list[dict]:
        return calls if self.parallel else [c for c in calls if c.get("index", 0) == 0]

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        if self.inner is None:
            return delta, []
        content, calls = self.inner.feed(delta)
        return content, self._keep(calls)

    def finish(self) -> tuple[str, list[dict]]:
        if self.inner is None:
            return "", []
        content, calls = self.inner.finish()
        return content, self._keep(calls)


def tool_call_chunks(calls: list[dict]) -> list[list[dict]]:
    """Tool-call deltas grouped into chunks as OpenAI streams them: every call's head (id, name,
    arguments "") opens a chunk of its own; the argument fragments after it go together in the next."""
    chunks: list[list[dict]] = []
    for d in calls:
        prev = chunks[-1][-1] if chunks else None
        if "id" in d or prev is None or "id" in prev or prev["index"] != d["index"]:
            chunks.append([d])
        else:
            merged = prev["function"]["arguments"] + d["function"]["arguments"]
            chunks[-1][-1] = {"index": d["index"], "function": {"arguments": merged}}
    return chunks


def _messages(body: ChatRequest) -> list[dict]:
    return [m.model_dump(exclude_none=True, by_alias=True) for m in body.messages]


def plan_chat(body: ChatRequest, tok) -> ChatPlan:
    tools = [t.model_dump(exclude_none=True, by_alias=True) for t in body.tools or ()]
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not isinstance(choice, str):
        names = {t["function"]["name"] for t in tools}
        if choice.function.name not in names:
            raise bad("tool_choice.function.name", f"no tool named {choice.function.name!r} in tools")
        choice = choice.model_dump(exclude_none=True)
    elif choice in ("required", "auto") and not tools:
        raise bad("tool_choice", f"{choice!r} needs tools")
    template = body.chat_template or tok.chat_template
    fmt = tc.tool_call_format(template)
    messages = _messages(body)
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    if tools and choice != "none" and "tools" not in (template or ""):
        # This template does not render tools: describe them (and the call format) in a system message.
        messages = [{"role": "system", "content": tc.tools_system_prompt(tools, fmt)}] + messages
    gen_prompt = body.add_generation_prompt and not body.continue_final_message
    try:
        prompt = render_chat(template, messages, tools=tools or None, add_generation_prompt=gen_prompt,
                             special=tok.special_tokens, **kwargs)
    except ValueError as e:
        msg = str(e)
        raise HTTPException(400, msg if msg.startswith(("messages", "chat_template")) else f"messages: {msg}") from None
    if body.continue_final_message:
        prompt = _continue(prompt, messages)
    grammar = _tool_grammar(tools, choice, fmt, body.parallel_tool_calls)
    ends = message_ends(template, messages, prompt, tools=tools or None, special=tok.special_tokens, **kwargs)
    return ChatPlan(prompt, tuple(tools) if choice != "none" else (), fmt, grammar, body.parallel_tool_calls, ends)


def token_ends(plan: ChatPlan, ids: list[int], encode) -> tuple[int, ...]:
    """``plan.message_ends`` as token positions in ``ids`` (the prompt's tokens): how many leading tokens
    the prompt shares with the encoding of the text up to each end (a token spanning an end belongs to
    the next message)."""
    out = []
    for c in plan.message_ends:
        part = encode(plan.prompt[:c])
        k, n = 0, min(len(part), len(ids))
        while k < n and part[k] == ids[k]:
            k += 1
        if k:
            out.append(k)
    return tuple(out)


def _tool_grammar(tools: list[dict], choice, fmt: str, parallel: bool) -> tuple[str, str] | None:
    """The grammar of the calls (auto included: a call the model opens is held to the same grammar),
    compiled here so that a schema llguidance cannot use is a 400 naming the tools, not a failed stream."""
    if not tools or choice == "none" or (choice == "auto" and not grammar_available()):
        return None     # without llguidance, auto still serves, unconstrained as before
    try:
        grammar = tc.tool_grammar(tools, choice, fmt, parallel)
    except ValueError as e:
        raise HTTPException(400, str(e)) from None
    try:
        compile_grammar(*grammar)
    except ValueError as e:
        if choice == "auto":
            # a valid schema llguidance cannot compile (e.g. "not"): auto had no grammar before and vLLM's
            # has none, so it still serves, unconstrained, rather than refusing the request
            return None
        raise bad("tools", f"the calls cannot be constrained to these schemas ({e})") from None
    return grammar


def _continue(prompt: str, messages: list[dict]) -> str:
    """``continue_final_message``: the prompt ends inside the last (assistant) message, right after its
    content, so the model continues it (what transformers does)."""
    last = messages[-1]
    content = last.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text") or "" for p in content)
    if last.get("role") != "assistant" or not content:
        raise bad("continue_final_message", "the last message must be an assistant message with content")
    at = prompt.rfind(content.strip())
    if at < 0:
        raise bad("continue_final_message", "the chat template does not render the last message's content")
    return prompt[:at + len(content.strip())]
