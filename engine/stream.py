"""What a request's stream carries from an engine to whoever serves it: ``StreamItem`` (new tokens, and the
final accounting on the last one), and a prefill-only request's ``PrefillResult``. Plain data, no torch:
the ingress and the token channel read them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from storage.transfer.payload import KVPayload


@dataclass
class StreamItem:
    """One piece of a request's stream: new tokens, and on the last item the final accounting."""

    rid: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    logprobs: list = field(default_factory=list)         # TokenLogprob per token of token_ids, if asked
    prompt_logprobs: list | None = None                  # prompt-token logprobs computed since the last item
    matched_stop: int | str | None = None                # on the last item: the stop id or string that ended it
    held_s: float = 0.0                                  # how long its first token waited on the worker (whole)


def merge_items(a: StreamItem, b: StreamItem) -> StreamItem:
    """``a`` then ``b`` of one request as one item: their tokens (and logprobs) in order, ``b``'s final
    accounting. ``a`` is changed and returned."""
    a.token_ids = a.token_ids + b.token_ids
    a.logprobs = a.logprobs + b.logprobs
    if b.prompt_logprobs is not None:
        a.prompt_logprobs = (a.prompt_logprobs or []) + b.prompt_logprobs
    a.finished, a.finish_reason, a.error, a.matched_stop = b.finished, b.finish_reason, b.error, b.matched_stop
    a.prompt_tokens, a.cached_tokens = b.prompt_tokens, b.cached_tokens
    a.cached_tokens_by_tier = b.cached_tokens_by_tier
    return a


class PrefillResult(NamedTuple):
    """What a prefill-only request leaves: its first token's (last) item, and the prompt's KV for a decode
    engine (None when there is nothing to hand over: the first token ended the request, or it failed)."""
    first: StreamItem
    payload: KVPayload | None
