"""From the sampling fields of a request (OpenAI/vLLM spellings or SGLang's) to ``SamplingParams``:
normalised stops, logit bias, seed and the one grammar a request may carry. 400s name the field."""
from __future__ import annotations

import json

from actors.frontend import bad

_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def regex_escape(s: str) -> str:
    """Escape for the regex dialect of llguidance (Rust's regex crate): only its metacharacters."""
    return "".join("\\" + c if c in _REGEX_META else c for c in s)


def stops(stop) -> tuple[str, ...]:
    out = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(s == "" for s in out):
        raise bad("stop", "a stop string must not be empty")
    return out


def logit_bias(bias: dict | None, vocab: int) -> tuple[tuple[int, float], ...]:
    out = []
    for k, v in (bias or {}).items():
        try:
            t = int(k)
        except ValueError:
            raise bad("logit_bias", f"key {k!r} is not a token id") from None
        if not 0 <= t < vocab:
            raise bad("logit_bias", f"token id {t} is outside the vocabulary [0, {vocab})")
        out.append((t, float(v)))
    return tuple(sorted(out))


def seed(s: int | None) -> int | None:
    return None if s is None else s % 2**63


def top_k(k: int | None) -> int:
    return 0 if k is None or k <= 0 else k


def one_grammar(**sources) -> tuple[str, str] | None:
    """At most one structured-output source per request: {field: (kind, text) or None}."""
    given = {f: g for f, g in sources.items() if g is not None}
    if len(given) > 1:
        raise bad(", ".join(sorted(given)), "only one structured-output constraint per request")
    return next(iter(given.values()), None)


def schema_text(schema, field: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise bad(field, f"not valid JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise bad(field, "a JSON schema must be an object")
    return json.dumps(schema)


def response_format_grammar(rf) -> tuple[str, str] | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return ("json_object", "")
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise bad("response_format.json_schema.schema", "required for type json_schema")
    return ("json_schema", schema_text(rf.json_schema.schema_, "response_format.json_schema.schema"))


def vllm_grammars(body) -> dict:
    """vLLM's guided_* fields and SGLang's regex/ebnf/json_schema as grammar sources."""
    out = {}
    if getattr(body, "guided_json", None) is not None:
        out["guided_json"] = ("json_schema", schema_text(body.guided_json, "guided_json"))
    if getattr(body, "guided_regex", None) is not None:
        out["guided_regex"] = ("regex", body.guided_regex)
    if getattr(body, "guided_choice", None) is not None:
        if not body.guided_choice:
            raise bad("guided_choice", "empty")
        out["guided_choice"] = ("regex", "(" + "|".join(regex_escape(c) for c in body.guided_choice) + ")")
    if getattr(body, "guided_grammar", None) is not None:
        out["guided_grammar"] = ("ebnf", body.guided_grammar)
    for f in ("regex", "ebnf"):
        if getattr(body, f, None) is not None:
            out[f] = (f, getattr(body, f))
    if getattr(body, "json_schema", None) is not None:
        out["json_schema"] = ("json_schema", schema_text(body.json_schema, "json_schema"))
    return out


def n_of(body) -> int:
    if body.best_of is not None and body.best_of != body.n:
        raise bad("best_of", f"only best_of == n is supported (got best_of={body.best_of}, n={body.n})")
    return body.n


SAMPLING_FALLBACK = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def sampling_value(body, name: str, defaults: dict, given: bool | None = None):
    """A request's value of ``name``; when the request did not set it, the checkpoint's default
    (generation_config.json), else the API's."""
    v = getattr(body, name)
    if given is None:
        given = v is not None
    return v if given else defaults.get(name, SAMPLING_FALLBACK[name])


def common_kwargs(body, vocab: int, defaults: dict | None = None) -> dict:
    """SamplingParams keyword arguments from the OpenAI/vLLM sampling fields of ``body``."""
    d = defaults or {}
    return dict(
        temperature=float(sampling_value(body, "temperature", d)),
        top_p=float(sampling_value(body, "top_p", d)),
        top_k=top_k(sampling_value(body, "top_k", d)), min_p=float(sampling_value(body, "min_p", d)),
        presence_penalty=float(body.presence_penalty or 0.0),
        frequency_penalty=float(body.frequency_penalty or 0.0),
        repetition_penalty=float(sampling_value(body, "repetition_penalty", d)),
        logit_bias=logit_bias(body.logit_bias, vocab), seed=seed(body.seed), stop=stops(body.stop),
        stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
        min_new_tokens=body.min_tokens, skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        no_stop_trim=body.include_stop_str_in_output or body.no_stop_trim)
