"""A request's grammar compiled and checked by llguidance, without torch: the ingress refuses an invalid
grammar with a 400 before any worker sees it, and the engine's matcher (engine/grammar.py) starts from
the same compiled grammar. llguidance is imported when present (see engine/grammar.py)."""
from __future__ import annotations

import functools
import json

try:
    import llguidance
    _IMPORT_ERROR: ImportError | None = None
except ImportError as e:
    llguidance = None
    _IMPORT_ERROR = e

_JSON_OPTIONS = {"whitespace_flexible": False}


def available() -> bool:
    """Whether structured output can be served here (llguidance imports)."""
    return llguidance is not None


def require() -> None:
    if llguidance is None:
        raise ValueError(f"grammar: structured output needs the llguidance package, which does not import "
                         f"here ({_IMPORT_ERROR}); pip install 'llguidance>=1.9,<2'")


@functools.lru_cache(maxsize=256)
def compile_grammar(kind: str, text: str) -> str:
    """(kind, text) -> an llguidance grammar; ValueError("grammar: ...") when it is not valid."""
    require()
    try:
        # Compact separators rather than free whitespace: a weak model otherwise pads JSON with
        # whitespace until it runs out of tokens (a schema's own "x-guidance" options still win).
        if kind == "json_object":
            g = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        elif kind == "json_schema":
            json.loads(text)
            g = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
        elif kind == "regex":
            g = llguidance.LLMatcher.grammar_from_regex(text)
        elif kind == "ebnf":
            g = llguidance.grammar_from("ebnf", text)
        elif kind == "lark":
            g = llguidance.LLMatcher.grammar_from_lark(text)
        else:
            raise ValueError(f"unknown kind {kind!r}")
    except ValueError as e:
        raise ValueError(f"grammar: invalid {kind}: {e}") from None
    err = llguidance.LLMatcher.validate_grammar(g)
    if err:
        raise ValueError(f"grammar: invalid {kind}: {err.strip()[:500]}")
    return g
