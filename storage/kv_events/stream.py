"""``TreeEventStream``: one radix tree's events on the wire -- the plain logic a worker's report thread
(actors/worker.py) or the L3 storage actor (actors/storage.py) runs over its ``KVEventPublisher``.

A flush is published as the flush's removals followed by ``AllBlocksCleared`` in the same batch (a
consumer that keys by block id drops the removals' blocks either way; one that only reads the clear drops
everything the publisher said before)."""
from __future__ import annotations

from typing import Iterable

from storage.kv_events.publisher import KVEventPublisher, KVEventsEndpoint, PublisherStats, StreamPosition
from storage.kv_events.translate import WireMapping, to_wire
from storage.kv_events.wire import AllBlocksCleared
from storage.radix.node import KVEvent


class TreeEventStream:
    """Translates (``mapping``) and publishes (``publisher``, which it owns and closes) batches of tree
    events."""

    def __init__(self, publisher: KVEventPublisher, mapping: WireMapping) -> None:
        self.publisher, self.mapping = publisher, mapping

    @property
    def endpoint(self) -> KVEventsEndpoint:
        return self.publisher.endpoint

    def publish(self, events: Iterable[KVEvent], ts: float, cleared: bool = False) -> int:
        """Publish ``events`` (the tree's, oldest first; tiers the mapping does not name are skipped) as one
        batch stamped ``ts``, closed by ``AllBlocksCleared`` when ``cleared``; its seq, -1 when nothing
        was published."""
        wire = to_wire(events, self.mapping)
        if cleared:
            wire.append(AllBlocksCleared())
        return self.publisher.publish(wire, ts)

    def snapshot(self, events: Iterable[KVEvent], ts: float) -> int:
        """Publish a snapshot: ``AllBlocksCleared`` then ``events`` (everything the tree holds, as stored
        events, parents first) in one batch, so a consumer applying it in order ends exact whatever it
        held before; its seq."""
        return self.publisher.publish([AllBlocksCleared(), *to_wire(events, self.mapping)], ts)

    def position(self) -> StreamPosition:
        return self.publisher.position()

    def stats(self) -> PublisherStats:
        return self.publisher.stats()

    def close(self) -> None:
        self.publisher.close()


__all__ = ["TreeEventStream"]
