"""A request's cache hit as SGLang's clients read it: ``cached_tokens_details`` with SGLang's tier names
(``device`` = L1, ``host`` = L2, and with an L3 store ``storage`` = L3 and ``storage_backend``), in
/generate's ``meta_info`` and, when a request sets ``return_cached_tokens_details``, in the ``sglext``
object of OpenAI-format responses (SGLang's extension field; ``sglang.bench_serving --cache-report``
asks for it and sums device + host + storage over its requests)."""
from __future__ import annotations

from typing import Iterable

TIERS = {"L1": "device", "L2": "host", "L3": "storage"}


def add_tiers(parts: Iterable[dict | None]) -> dict[str, int]:
    """Per-tier token counts summed over ``parts`` (cached_tokens_by_tier dicts; None skipped)."""
    out = dict.fromkeys(TIERS, 0)
    for p in parts:
        for t in TIERS:
            out[t] += int((p or {}).get(t, 0))
    return out


def cached_tokens_details(by_tier: dict | None, storage_backend: str | None) -> dict:
    """SGLang's ``cached_tokens_details`` from strata's ``cached_tokens_by_tier``. ``storage`` appears only
    with an L3 store (``storage_backend``: its backend), as SGLang leaves it out without one."""
    t = by_tier or {}
    out = {"device": int(t.get("L1", 0)), "host": int(t.get("L2", 0))}
    if storage_backend is not None:
        out.update(storage=int(t.get("L3", 0)), storage_backend=storage_backend)
    return out


def sglext(by_tier: dict | None, storage_backend: str | None) -> dict:
    """The ``sglext`` object of an OpenAI-format response that asked for cached_tokens_details."""
    return {"cached_tokens_details": cached_tokens_details(by_tier, storage_backend)}
