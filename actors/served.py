"""Which workers serve a request, as one typed value from the backend's choice to the HTTP answer.

A backend (actors/ingress.RayBackend, actors/local_backend.LocalBackend) chooses the workers once per
request, before any token; the choice travels beside the request's items (a ``ServedStream``), not on
each of them, and the frontend keeps it on the sample: the samples of one prompt are pinned to it, and
SGLang's ``meta_info.route`` shows it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncGenerator

from engine.stream import StreamItem


@dataclass(frozen=True)
class Served:
    """``prefill``: the worker that computes the prompt (the only one when colocated); ``decode``: the
    worker that streams the rest (None: colocated); ``predicted_cached_tokens``: the prompt tokens the
    router expected to find cached when it chose them (None when nobody predicted: a pinned request, one
    engine)."""
    prefill: str
    decode: str | None = None
    predicted_cached_tokens: int | None = None

    def route_json(self) -> dict[str, str | int | None]:
        """SGLang's ``meta_info.route`` as users have always read it: prefill, decode (null when
        colocated), and predicted_cached_tokens only when known (the JSON edge, not a contract)."""
        out: dict[str, str | int | None] = {"prefill": self.prefill, "decode": self.decode}
        if self.predicted_cached_tokens is not None:
            out["predicted_cached_tokens"] = self.predicted_cached_tokens
        return out


class ServedStream:
    """One request's ``StreamItem``s from a backend, and the ``Served`` workers behind them.

    Built over an async generator that yields the ``Served`` once, before its first item (a backend may
    choose after awaiting its router); ``served`` is None until then, and set from the first item on.
    Iterating yields only the items."""
    __slots__ = ("served", "_gen")

    def __init__(self, gen: AsyncGenerator[Served | StreamItem, None]) -> None:
        self._gen = gen
        self.served: Served | None = None

    def __aiter__(self) -> ServedStream:
        return self

    async def __anext__(self) -> StreamItem:
        x = await self._gen.__anext__()
        if self.served is None:
            if not isinstance(x, Served):
                raise TypeError(f"a backend's stream must say which workers serve it first, got {type(x).__name__}")
            self.served = x
            x = await self._gen.__anext__()
        return x

    async def aclose(self) -> None:
        await self._gen.aclose()
