"""The field's KV-event wire (the format vLLM and SGLang publish, Dynamo's and llm-d's indexers read):
its three event types, the batch, and their msgpack encoding. Pure: no sockets (publisher.py), no tree
(translate.py).

A batch is the msgpack array ``[ts, events, data_parallel_rank]``. An event is encoded one of two ways,
both readable by every consumer of the wire, and ``decode_batch`` accepts either (even mixed):

* ``tagged`` (the default): a map whose ``type`` key names the event, then one key per field;
* ``positional``: an array whose first element is the event's name and the rest its fields in the order
  below (what a msgspec Struct declared ``array_like=True, tag=True`` writes). A decoder fills fields
  missing at the end with their defaults and ignores extra trailing elements (older and newer
  producers); a map decoder ignores unknown keys.

Field order (it is the positional layout; do not reorder):

* ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
  extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window
* ``BlockRemoved``: block_hashes, medium, group_idx
* ``AllBlocksCleared``: no field

Block hashes are unsigned 64-bit ints here (translate.block_hash); a decoder takes any int (Dynamo folds
signed producers onto u64 the same way), or bytes, which some producers send.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import msgpack

TAGGED = "tagged"
POSITIONAL = "positional"
ENCODINGS = (TAGGED, POSITIONAL)

GPU, CPU, CPU_PINNED, DISK, EXTERNAL = "GPU", "CPU", "CPU_PINNED", "DISK", "EXTERNAL"
"""The ``medium`` names: the device tier (GPU, or CPU for a CPU device), pinned host memory, a disk
store, an external (remote) store."""
MEDIA = (GPU, CPU, CPU_PINNED, DISK, EXTERNAL)

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"

BlockHash = Union[int, bytes]


class BlockStored(NamedTuple):
    """``block_hashes`` (one per block of ``block_size`` tokens, parent before child) gained KV in
    ``medium``. ``token_ids``: the ``len(block_hashes) * block_size`` tokens of those blocks;
    ``parent_block_hash``: the block before the first one (None at the start of a sequence).
    ``group_idx`` / ``kv_cache_spec_kind`` / ``kv_cache_spec_sliding_window``: which KV-cache group
    (strata: 0 full attention, 1 sliding window of that many tokens)."""

    block_hashes: list[BlockHash]
    parent_block_hash: Optional[BlockHash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None
    lora_name: Optional[str] = None
    extra_keys: Optional[list] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class BlockRemoved(NamedTuple):
    """``block_hashes`` lost their KV in ``medium`` (for group 1: the window is gone, a tombstone)."""

    block_hashes: list[BlockHash]
    medium: Optional[str] = None
    group_idx: Optional[int] = None


class AllBlocksCleared(NamedTuple):
    """The publisher dropped everything it held (a flush, or a store that restarted empty)."""


KVWireEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
EVENT_TYPES = {t.__name__: t for t in (BlockStored, BlockRemoved, AllBlocksCleared)}


class EventBatch(NamedTuple):
    """One published message: ``events`` in order, stamped ``ts`` (seconds since the epoch)."""

    ts: float
    events: list[KVWireEvent]
    data_parallel_rank: Optional[int] = None


# The field names once, as tuples: encode walks them per event.
_FIELDS = {name: t._fields for name, t in EVENT_TYPES.items()}


def encode_event(event: KVWireEvent, encoding: str = TAGGED) -> Any:
    """The msgpack-ready form of one event (a dict or a list, see the module doc)."""
    name = type(event).__name__
    if encoding == TAGGED:
        out = {"type": name}
        out.update(zip(_FIELDS[name], event))
        return out
    if encoding == POSITIONAL:
        return [name, *event]
    raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")


def encode_batch(batch: EventBatch, encoding: str = TAGGED) -> bytes:
    """The payload frame of ``batch``: msgpack ``[ts, events, data_parallel_rank]``."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    return msgpack.packb([batch.ts, [encode_event(e, encoding) for e in batch.events], batch.data_parallel_rank],
                         use_bin_type=True)


def decode_event(raw: Any) -> KVWireEvent:
    """One event from its tagged-map or positional form; ValueError when it is neither."""
    if isinstance(raw, dict):
        name = raw.get("type")
        cls = EVENT_TYPES.get(name)
        if cls is None:
            raise ValueError(f"unknown KV event type {name!r}")
        try:
            return cls(**{f: raw[f] for f in cls._fields if f in raw})
        except TypeError as e:   # a required field is missing
            raise ValueError(f"{name}: {e}") from None
    if isinstance(raw, (list, tuple)) and raw:
        cls = EVENT_TYPES.get(raw[0])
        if cls is None:
            raise ValueError(f"unknown KV event type {raw[0]!r}")
        try:
            return cls(*raw[1:1 + len(cls._fields)])
        except TypeError as e:
            raise ValueError(f"{raw[0]}: {e}") from None
    raise ValueError(f"a KV event is a tagged map or a tagged array, got {type(raw).__name__}")


def decode_batch(payload: bytes) -> EventBatch:
    """The batch of a payload frame (events in either encoding); ValueError when it is not one."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for bad bytes
        raise ValueError(f"not a msgpack KV event batch: {e}") from None
    if not isinstance(raw, (list, tuple)) or len(raw) < 2 or not isinstance(raw[1], (list, tuple)):
        raise ValueError("a KV event batch is [ts, events, data_parallel_rank]")
    rank = raw[2] if len(raw) > 2 else None
    return EventBatch(float(raw[0]), [decode_event(e) for e in raw[1]], rank)


def encode_seq(seq: int) -> bytes:
    """A sequence number frame: 8 bytes, big-endian, signed (-1 ends a replay)."""
    return int(seq).to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"a sequence frame is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


END_OF_REPLAY = encode_seq(-1)
"""The seq frame closing a replay answer (its payload frame is empty)."""


def topic(host: str, port: int, model: str) -> str:
    """The PUB topic ``kv@<host>:<port>@<model>`` (llm-d's indexer reads host, port and model from it)."""
    return f"kv@{host}:{port}@{model}"


__all__ = ["TAGGED", "POSITIONAL", "ENCODINGS", "GPU", "CPU", "CPU_PINNED", "DISK", "EXTERNAL", "MEDIA",
           "FULL_ATTENTION", "SLIDING_WINDOW", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVWireEvent",
           "EventBatch", "encode_event", "encode_batch", "decode_event", "decode_batch", "encode_seq", "decode_seq",
           "END_OF_REPLAY", "topic"]
