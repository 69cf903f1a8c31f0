"""Which page keys the objects of an L3 store hold: the bridge between a store's eviction (which sees object
names, ``key_digest(l3_key(...)).hex()``) and the router's prefix index (which sees page keys).

The router feeds it the L3 writes workers report (``stored``); when the store's owner evicts objects it
reports their names, and ``removed`` turns the names this index knows into ``removed`` KV events, so the
router stops counting pages L3 no longer has. Names it never saw stored (written before this index
existed) are ignored: the router never counted them either.
"""
from __future__ import annotations

from typing import Iterable

from storage.l3.base import key_digest, l3_key
from storage.radix.node import L3, KVEvent


class L3NameIndex:
    def __init__(self, model_id: str) -> None:
        l3_key(model_id, "full", b"\0")            # validates model_id
        self.model_id = model_id
        self._names: dict[str, tuple[str, bytes]] = {}   # object name -> (component, page key)

    def __len__(self) -> int:
        return len(self._names)

    def name(self, component: str, page_key: bytes) -> str:
        return key_digest(l3_key(self.model_id, component, page_key)).hex()

    def stored(self, events: Iterable[KVEvent]) -> None:
        """Record the L3 ``stored`` events among ``events`` (anything else is skipped)."""
        for ev in events:
            if ev.tier == L3 and ev.kind == "stored":
                for k in ev.page_keys:
                    self._names[self.name(ev.component, k)] = (ev.component, k)

    def removed(self, names: Iterable[str]) -> list[KVEvent]:
        """``removed`` L3 events for the evicted object ``names`` this index knows (one per page)."""
        out = []
        for name in names:
            hit = self._names.pop(name, None)
            if hit is not None:
                out.append(KVEvent("removed", L3, hit[0], (hit[1],)))
        return out

    def entries(self) -> list[tuple[str, str]]:
        """(store key, object name) of every page this index believes the store holds (for an audit)."""
        return [(l3_key(self.model_id, c, k), name) for name, (c, k) in self._names.items()]

    def clear(self) -> None:
        self._names.clear()
