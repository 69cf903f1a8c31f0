"""Logprobs in the shapes clients parse: OpenAI chat (``content`` entries with bytes), OpenAI
completions (tokens / token_logprobs / top_logprobs / text_offset), vLLM's ``prompt_logprobs`` and
SGLang's ``(logprob, token_id, text)`` triples. The engine gives ``TokenLogprob(token_id, logprob, top)``;
a logprob of -inf (a token a mask forbade) is sent as -9999.0, since JSON has no infinity."""
from __future__ import annotations

import math

FLOOR = -9999.0


def _lp(x: float | None) -> float | None:
    if x is None:
        return None
    return FLOOR if math.isinf(x) or math.isnan(x) else max(float(x), FLOOR)


def token_text(tok, tid: int, as_ids: bool = False) -> str:
    if as_ids:
        return f"token_id:{tid}"
    return tok.decode([tid], skip_special_tokens=False)


def token_bytes(tok, tid: int) -> list[int]:
    f = getattr(tok, "token_bytes", None)
    return list(f(tid)) if f is not None else list(token_text(tok, tid).encode("utf-8", "replace"))


def chat_logprobs(tok, lps: list, top_n: int, as_ids: bool = False) -> dict:
    """OpenAI chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}."""
    def entry(tid, lp):
        return {"token": token_text(tok, tid, as_ids), "logprob": _lp(lp), "bytes": token_bytes(tok, tid)}
    return {"content": [{**entry(t.token_id, t.logprob),
                         "top_logprobs": [entry(i, v) for i, v in t.top[:top_n]]} for t in lps],
            "refusal": None}


def completion_logprobs(tok, lps: list, top_n: int, prompt: list | None = None, prompt_ids=(),
                        offset0: int = 0, as_ids: bool = False) -> dict:
    """OpenAI completions' legacy shape. With ``prompt`` (echo): the prompt tokens first, the very first
    without a logprob. ``text_offset``: each token's character offset in the returned text."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset0
    rows = []
    if prompt is not None:
        for i, tid in enumerate(prompt_ids):
            e = prompt[i] if i < len(prompt) else None
            rows.append((tid, None if e is None else e.logprob, None if e is None else e.top))
    rows += [(t.token_id, t.logprob, t.top) for t in lps]
    for tid, lp, top in rows:
        s = token_text(tok, tid, as_ids)
        tokens.append(s)
        token_lps.append(_lp(lp))
        tops.append(None if top is None else {token_text(tok, i, as_ids): _lp(v) for i, v in top[:top_n]})
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(tok, prompt_ids: list[int], plps: list | None, top_n: int) -> list:
    """vLLM's ``prompt_logprobs``: per prompt position None (the first) or {id: {logprob, rank,
    decoded_token}} with the prompt token and the top-N alternatives."""
    out: list = []
    plps = plps or []
    for i, tid in enumerate(prompt_ids):
        e = plps[i] if i < len(plps) else None
        if e is None:
            out.append(None)
            continue
        top = list(e.top[:top_n])
        ids = [x for x, _ in top]
        d = {str(e.token_id): {"logprob": _lp(e.logprob),
                               "rank": ids.index(e.token_id) + 1 if e.token_id in ids else None,
                               "decoded_token": token_text(tok, e.token_id)}}
        for r, (x, v) in enumerate(top, 1):
            d.setdefault(str(x), {"logprob": _lp(v), "rank": r, "decoded_token": token_text(tok, x)})
        out.append(d)
    return out


def sglang_triples(tok, lps: list, with_text: bool) -> list:
    return [[_lp(t.logprob), t.token_id, token_text(tok, t.token_id) if with_text else None] for t in lps]


def sglang_top(tok, lps: list, top_n: int, with_text: bool) -> list:
    return [None if t is None else [[_lp(v), i, token_text(tok, i) if with_text else None]
                                    for i, v in t.top[:top_n]] for t in lps]


def sglang_input(tok, prompt_ids: list[int], start: int, plps: list | None, with_text: bool) -> list:
    """SGLang's input_token_logprobs from ``start``: the first prompt token has no logprob (None)."""
    plps = plps or []
    out = []
    for k, tid in enumerate(prompt_ids[start:]):
        e = plps[k] if k < len(plps) else None
        out.append([None if e is None else _lp(e.logprob), tid, token_text(tok, tid) if with_text else None])
    return out
