"""Which page keys the objects of an L3 store hold: the bridge between a store's eviction (which sees object
names, ``key_digest(l3_key(...)).hex()``) and the KV-event wire (which names pages by their keys).

The L3 store's publisher (storage/kv_events/l3_stream.py) feeds it the L3 writes workers forward
(``stored``); when the store evicts objects, ``removed`` turns the names this index knows into ``removed``
KV events, so no consumer counts pages L3 no longer has. Names it never saw stored (written before this
index existed) are ignored: no consumer counted them either. It keeps each page's parent and tokens, so
``snapshot`` can say again, parents first, everything it holds.
"""
from __future__ import annotations

from typing import Iterable

from storage.l3.base import key_digest, l3_key
from storage.radix.node import L3, KVEvent


class L3NameIndex:
    def __init__(self, model_id: str) -> None:
        l3_key(model_id, "full", b"\0")            # validates model_id
        self.model_id = model_id
        # object name -> (component, page key, parent page key or None, the page's tokens or None)
        self._names: dict[str, tuple[str, bytes, bytes | None, tuple | None]] = {}

    def __len__(self) -> int:
        return len(self._names)

    def name(self, component: str, page_key: bytes) -> str:
        return key_digest(l3_key(self.model_id, component, page_key)).hex()

    def stored(self, events: Iterable[KVEvent]) -> None:
        """Record the L3 ``stored`` events among ``events`` (anything else is skipped)."""
        for ev in events:
            if ev.tier == L3 and ev.kind == "stored":
                keys, toks = ev.page_keys, ev.tokens
                size = len(toks) // len(keys) if toks else 0
                parent = ev.parent
                for i, k in enumerate(keys):
                    page = tuple(toks[i * size:(i + 1) * size]) if size else None
                    self._names[self.name(ev.component, k)] = (ev.component, k, parent, page)
                    parent = k

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
        return [(l3_key(self.model_id, c, k), name) for name, (c, k, _p, _t) in self._names.items()]

    def snapshot(self) -> list[KVEvent]:
        """A ``stored`` event per page this index holds, each after its parent when the parent is held too
        (a consumer keyed by parents, Dynamo's, drops a block whose parent it does not know)."""
        out: list[KVEvent] = []
        for comp in ("full", "swa"):
            pages = {k: (p, t) for c, k, p, t in self._names.values() if c == comp}
            done: set[bytes] = set()
            for key in pages:
                chain = []
                while key is not None and key in pages and key not in done:
                    chain.append(key)
                    done.add(key)
                    key = pages[key][0]
                for k in reversed(chain):
                    p, t = pages[k]
                    out.append(KVEvent("stored", L3, comp, (k,), list(t) if t is not None else None, p))
        return out

    def clear(self) -> None:
        self._names.clear()
