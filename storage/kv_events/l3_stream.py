"""``L3EventStream``: the shared L3 store's changes on the KV-event wire, published once for the cluster by
the storage actor (actors/storage.py), never per worker (a worker does not own L3 pages, and must not be
said to lose them).

What is known where: a worker writes L3 pages itself and its tree records the write (an L3 ``stored``
event, with the pages' tokens and parent); it forwards those to the storage actor, which publishes them.
The store's evictor only sees object names; the ``L3NameIndex`` (storage/l3/index.py) of the writes seen
maps them back to page keys (names never seen stored are not published: no consumer counted them). A
store that comes back empty, or the cluster flush's L3 clear, is ``AllBlocksCleared``."""
from __future__ import annotations

from typing import Iterable

from storage.kv_events.stream import TreeEventStream
from storage.l3.index import L3NameIndex
from storage.radix.node import L3, KVEvent


class L3EventStream:
    """Publishes L3 writes, evictions and clears on ``stream`` (whose mapping names the L3 medium),
    mapping evicted object names through ``names``."""

    def __init__(self, stream: TreeEventStream, names: L3NameIndex) -> None:
        self.stream, self.names = stream, names

    def stored(self, events: Iterable[KVEvent], ts: float) -> int:
        """The L3 ``stored`` events among ``events`` (a worker's tree's): recorded and published; the seq."""
        mine = [e for e in events if e.tier == L3 and e.kind == "stored"]
        self.names.stored(mine)
        return self.stream.publish(mine, ts)

    def evicted(self, object_names: Iterable[str], ts: float) -> int:
        """The store evicted these objects: ``BlockRemoved`` for the pages they held; the seq."""
        return self.stream.publish(self.names.removed(object_names), ts)

    def cleared(self, ts: float) -> int:
        """The store lost everything (a restart, the cluster flush): ``AllBlocksCleared``; the seq."""
        self.names.clear()
        return self.stream.publish([], ts, cleared=True)

    def snapshot(self, ts: float) -> int:
        """Everything the store is known to hold, as a snapshot (TreeEventStream.snapshot); the seq."""
        return self.stream.snapshot(self.names.snapshot(), ts)

    def close(self) -> None:
        self.stream.close()


__all__ = ["L3EventStream"]
