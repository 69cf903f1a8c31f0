"""The field's KV-event wire (vLLM's format over ZMQ, with replay): what a strata process publishes of its
cache so that any consumer of that wire (strata's router, Dynamo's indexer, llm-d's) can index it.

wire.py (event types, encode/decode, both encodings), translate.py (tree events -> wire events: block ids,
groups, media), config.py (``KVEventsConfig``), publisher.py (``KVEventPublisher``: PUB + replay sockets), stream.py (``TreeEventStream``: a
tree's events, translated and published), subscriber.py (``KVEventSubscriber``: the consuming end, many
publishers, gaps replayed; strata's router reads the wire through it).
"""
from storage.kv_events.config import KVEventsConfig
from storage.kv_events.publisher import KVEventPublisher, KVEventsEndpoint, PublisherStats, StreamPosition
from storage.kv_events.subscriber import Delivered, KVEventSubscriber, Lost, SubscriberStats
from storage.kv_events.stream import TreeEventStream
from storage.kv_events.translate import (FULL_GROUP, SLIDING_GROUP, WireMapping, block_hash, l3_medium,
                                         to_wire, worker_media)
from storage.kv_events.wire import (CPU, CPU_PINNED, DISK, END_OF_REPLAY, ENCODINGS, EXTERNAL, FULL_ATTENTION, GPU,
                                    POSITIONAL, SLIDING_WINDOW, TAGGED, AllBlocksCleared, BlockRemoved, BlockStored,
                                    EventBatch, KVWireEvent, decode_batch, decode_event, decode_seq, encode_batch,
                                    encode_event, encode_seq, topic)

__all__ = ["KVEventsConfig", "KVEventPublisher", "KVEventsEndpoint", "PublisherStats", "StreamPosition",
           "Delivered", "KVEventSubscriber", "Lost", "SubscriberStats", "TreeEventStream", "FULL_GROUP", "SLIDING_GROUP",
           "WireMapping", "block_hash", "l3_medium", "to_wire", "worker_media", "CPU", "CPU_PINNED", "DISK",
           "END_OF_REPLAY", "ENCODINGS", "EXTERNAL", "FULL_ATTENTION", "GPU", "POSITIONAL", "SLIDING_WINDOW", "TAGGED",
           "AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "KVWireEvent", "decode_batch",
           "decode_event", "decode_seq", "encode_batch", "encode_event", "encode_seq", "topic"]
