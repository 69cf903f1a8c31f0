"""Logprobs in the shapes clients parse: OpenAI chat (``content`` entries with bytes), OpenAI
completions (tokens / token_logprobs / top_logprobs / text_offset), vLLM's ``prompt_logprobs`` and
SGLang's ``(logprob, token_id, text)`` triples. The engine gives ``TokenLogprob(token_id, logprob, top)``;
a logprob of -inf (a token a mask forbade) is sent as -9999.0, since JSON has no infinity."""
from __future__ import annotations

import math

from actors import token_text as tt

FLOOR = -9999.0


def _lp(x: float | None) -> float | None:
    if x is None:
        return None
    return FLOOR if math.isinf(x) or math.isnan(x) else max(float(x), FLOOR)


def token_text(tok, tid: int, as_ids: bool = False) -> str:
    """The token decoded alone (SGLang's and vLLM's ``decoded_token``: a byte fragment is U+FFFD)."""
    if as_ids:
        return f"token_id:{tid}"
    return tok.decode([tid], skip_special_tokens=False)


def chat_logprobs(tok, lps: list, top_n: int, as_ids: bool = False) -> dict:
    """OpenAI chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}; ``bytes`` are
    the token's own bytes (a fragment of a character included), ``token`` its distinct name."""
    def entry(tid, lp, name):
        return {"token": name, "logprob": _lp(lp), "bytes": list(tt.token_bytes(tok, tid))}
    out = []
    for t in lps:
        top = list(t.top[:top_n])
        names = tt.distinct_names(tok, [i for i, _ in top], as_ids, keep=t.token_id)
        out.append({**entry(t.token_id, t.logprob, tt.token_name(tok, t.token_id, as_ids)),
                    "top_logprobs": [entry(i, v, n) for (i, v), n in zip(top, names)]})
    return {"content": out, "refusal": None}


def completion_logprobs(tok, lps: list, top_n: int, offsets: tt.TextOffsets, prompt: list | None = None,
                        prompt_ids=(), as_ids: bool = False) -> dict:
    """OpenAI completions' legacy shape. With ``prompt`` (echo): the prompt tokens first, the very first
    without a logprob. ``text_offset``: each token's character offset in the returned text: the echoed
    prompt's from 0, the completion's from ``offsets`` (started after the echo; a stream passes the same
    one for every chunk, so offsets run on). ``tokens`` and the ``top_logprobs`` keys are distinct names
    (actors/token_text.py), so asking for N alternatives gives N entries."""
    rows = []
    if prompt is not None:
        for i, tid in enumerate(prompt_ids):
            e = prompt[i] if i < len(prompt) else None
            rows.append((tid, None if e is None else e.logprob, None if e is None else e.top))
    rows += [(t.token_id, t.logprob, t.top) for t in lps]
    tokens, token_lps, tops = [], [], []
    for tid, lp, top in rows:
        tokens.append(tt.token_name(tok, tid, as_ids))
        token_lps.append(_lp(lp))
        if top is None:
            tops.append(None)
            continue
        top = list(top[:top_n])
        names = tt.distinct_names(tok, [i for i, _ in top], as_ids, keep=tid)
        tops.append({n: _lp(v) for n, (_i, v) in zip(names, top)})
    n_prompt = len(rows) - len(lps)
    before = tt.TextOffsets(tok, skip_special=False).feed(list(prompt_ids)[:n_prompt])  # echo keeps specials
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": before + offsets.feed([t.token_id for t in lps])}


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
        # The engine counts the prompt token's rank over the whole vocabulary (it is often outside the top).
        rank = e.rank if e.rank is not None else (ids.index(e.token_id) + 1 if e.token_id in ids else None)
        d = {str(e.token_id): {"logprob": _lp(e.logprob), "rank": rank,
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
