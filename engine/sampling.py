"""Sampling parameters of one request (validated on construction: a ValueError names the field) and the
typed logprob record the engine returns. The sampler itself is engine/sampler.py."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf", "lark")
MAX_TOP_LOGPROBS = 20


class TokenLogprob(NamedTuple):
    """A chosen token's logprob and, when asked, the top-N alternatives (id, logprob), best first.
    ``rank``: 1 + how many tokens of the vocabulary are more likely (vLLM's rank), where computed (prompt
    tokens: a prompt token is often outside the top-N, so its rank cannot be read off ``top``)."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


def _int(name: str, v, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f" in [{lo}, {hi}]" if hi is not None else (f" >= {lo}" if lo is not None else "")
        raise ValueError(f"{name}: must be an int{rng}, got {v!r}")


def _float(name: str, v, lo: float, hi: float, lo_open: bool = False) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
        and (v > lo if lo_open else v >= lo) and v <= hi
    if not ok:
        raise ValueError(f"{name}: must be a number in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}")


def _bool(name: str, v) -> None:
    if not isinstance(v, bool):
        raise ValueError(f"{name}: must be a bool, got {v!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    Sampling order (engine/sampler.py): logit_bias, repetition/presence/frequency penalties, the
    min_new_tokens and grammar masks give the *processed* logits; logprobs are log_softmax of those;
    then temperature, top-k, top-p and min-p choose the token. ``stop`` strings end generation once the
    decoded completion contains one (after ``min_new_tokens``); trimming them from text is the caller's
    (``no_stop_trim`` and the two decode options are carried for it)."""

    max_new_tokens: int = 16
    temperature: float = 0.0           # 0 means greedy
    top_k: int = 0                     # 0 means no top-k cut
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0      # OpenAI: over the tokens generated so far
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0    # CTRL / transformers: over prompt and generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False
    ignore_eos: bool = False
    min_new_tokens: int = 0
    logprobs: bool = False             # each generated token's logprob
    top_logprobs: int = 0              # and the top-N alternatives (implies logprobs)
    logprob_start_len: int = -1        # >= 0: prompt tokens' logprobs too, from this position
    grammar: tuple[str, str] | None = None   # (kind, text): kind in GRAMMAR_KINDS
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_logits: bool = False        # keep each step's next-token logits (tests, scoring)
    # Not sampling: a cache hint that travels with the request through every hop (ingress, P/D prefill,
    # decode). Token positions where the prompt's messages end (engine/model/chat.py): the prefix cache
    # keeps the sliding window before each, where a later prompt editing or adding a message branches off.
    message_boundaries: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _int("max_new_tokens", self.max_new_tokens, 0)
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not self.temperature >= 0 or math.isinf(self.temperature):
            raise ValueError(f"temperature: must be a number >= 0, got {self.temperature!r}")
        _int("top_k", self.top_k, 0)
        _float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _float("min_p", self.min_p, 0.0, 1.0)
        _float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _float("repetition_penalty", self.repetition_penalty, 0.0, 2.0, lo_open=True)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((t, float(b)) for t, b in bias))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias: must map token ids to numbers, got {self.logit_bias!r}") from None
        for t, b in bias:
            _int("logit_bias", t, 0)
            _float("logit_bias", b, -100.0, 100.0)
        object.__setattr__(self, "logit_bias", bias)
        if self.seed is not None:
            _int("seed", self.seed)
        stop_ids = tuple(self.stop_token_ids)
        for t in stop_ids:
            _int("stop_token_ids", t, 0)
        object.__setattr__(self, "stop_token_ids", stop_ids)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop: must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        for name in ("no_stop_trim", "ignore_eos", "logprobs", "skip_special_tokens",
                     "spaces_between_special_tokens", "return_logits"):
            _bool(name, getattr(self, name))
        _int("min_new_tokens", self.min_new_tokens, 0)
        _int("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        _int("logprob_start_len", self.logprob_start_len, -1)
        marks = tuple(self.message_boundaries)
        for b in marks:
            _int("message_boundaries", b, 1)
        object.__setattr__(self, "message_boundaries", tuple(sorted(set(marks))))
        if self.grammar is not None:
            g = tuple(self.grammar)
            if len(g) != 2 or g[0] not in GRAMMAR_KINDS or not isinstance(g[1], str):
                raise ValueError(f"grammar: must be (kind, text) with kind in {GRAMMAR_KINDS}, got {self.grammar!r}")
            object.__setattr__(self, "grammar", g)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

