"""The field's KV-event wire (storage/kv_events/): encode/decode in both encodings, block ids, and the
translation of the radix tree's events (groups, media, tokens, parents, order). Pure: no sockets."""
from __future__ import annotations

from typing import Any, Optional, Union

import msgpack
import pytest

from storage.hashing import page_keys
from storage.kv_events import (CPU, CPU_PINNED, DISK, EXTERNAL, FULL_ATTENTION, GPU, POSITIONAL, SLIDING_WINDOW,
                               TAGGED, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEventsConfig,
                               WireMapping, block_hash, decode_batch, decode_event, decode_seq, encode_batch,
                               encode_seq, l3_medium, to_wire, topic, worker_media)
from storage.radix import FULL, L1, L2, L3, SWA, KVEvent, RadixTree

PS, W = 4, 2   # tokens per page, window in pages

STORED = BlockStored([1, 2**64 - 1], None, list(range(8)), 4, None, GPU, None, None, 0, FULL_ATTENTION, None)
EVENTS = [STORED, BlockStored([3], 2**64 - 1, [8, 9, 10, 11], 4, medium=CPU_PINNED, group_idx=1,
                              kv_cache_spec_kind=SLIDING_WINDOW, kv_cache_spec_sliding_window=8),
          BlockRemoved([3], CPU_PINNED, 1), AllBlocksCleared()]


@pytest.mark.parametrize("encoding", [TAGGED, POSITIONAL])
def test_round_trip_in_both_encodings(encoding):
    payload = encode_batch(EventBatch(1.5, EVENTS, 0), encoding)
    got = decode_batch(payload)
    assert got.events == EVENTS and got.data_parallel_rank == 0
    assert encode_batch(got, encoding) == payload   # ts included, byte for byte


def test_the_two_encodings_on_the_wire():
    tagged = msgpack.unpackb(encode_batch(EventBatch(0.0, EVENTS), TAGGED))
    positional = msgpack.unpackb(encode_batch(EventBatch(0.0, EVENTS), POSITIONAL))
    assert len(tagged) == 3 and tagged[2] is None
    assert tagged[1][0] == {"type": "BlockStored", "block_hashes": [1, 2**64 - 1], "parent_block_hash": None,
                            "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU",
                            "lora_name": None, "extra_keys": None, "group_idx": 0,
                            "kv_cache_spec_kind": "full_attention", "kv_cache_spec_sliding_window": None}
    assert tagged[1][2] == {"type": "BlockRemoved", "block_hashes": [3], "medium": "CPU_PINNED", "group_idx": 1}
    assert tagged[1][3] == {"type": "AllBlocksCleared"}
    # The tag first, then the fields in declaration order.
    assert positional[1][0] == ["BlockStored", [1, 2**64 - 1], None, list(range(8)), 4, None, "GPU", None, None, 0,
                                "full_attention", None]
    assert positional[1][2] == ["BlockRemoved", [3], "CPU_PINNED", 1]
    assert positional[1][3] == ["AllBlocksCleared"]


def test_decode_accepts_mixed_short_and_long_forms():
    raw = [2.0, [["BlockStored", [5], None, [1, 2, 3, 4], 4, None, "GPU"],             # an older, shorter producer
                 {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "later_field": 1},
                 ["BlockRemoved", [5], "GPU", 0, "full_attention", "a field from the future"]]]
    got = decode_batch(msgpack.packb(raw))
    assert got.data_parallel_rank is None
    assert got.events == [BlockStored([5], None, [1, 2, 3, 4], 4, None, GPU), BlockRemoved([5], GPU),
                          BlockRemoved([5], GPU, 0)]


@pytest.mark.parametrize("bad", [b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0, [["Nope"]]]),
                                 msgpack.packb([1.0, [{"type": "BlockStored"}]]), msgpack.packb([1.0, [7]])])
def test_decode_rejects_what_is_not_a_batch(bad):
    with pytest.raises(ValueError):
        decode_batch(bad)


def test_encode_rejects_an_unknown_encoding():
    with pytest.raises(ValueError):
        encode_batch(EventBatch(0.0, EVENTS), "json")
    with pytest.raises(ValueError):
        decode_event(42)


def test_seq_frames_and_topic():
    assert encode_seq(0) == bytes(8) and encode_seq(1) == b"\0" * 7 + b"\1"
    assert encode_seq(-1) == b"\xff" * 8 and decode_seq(encode_seq(-1)) == -1
    assert decode_seq(encode_seq(2**40 + 3)) == 2**40 + 3
    with pytest.raises(ValueError):
        decode_seq(b"\0")
    assert topic("10.0.0.7", 5557, "strata-tiny") == "kv@10.0.0.7:5557@strata-tiny"


def test_block_hash_is_a_stable_u64_of_the_page_key():
    keys = page_keys(list(range(3 * PS)), PS)
    ids = [block_hash(k) for k in keys]
    # Pinned values: the ids are a wire contract, the same in every process, machine and release.
    assert ids == [block_hash(k) for k in page_keys(list(range(3 * PS)), PS)]
    assert all(0 <= i < 2**64 for i in ids) and len(set(ids)) == 3
    assert ids[0] == int.from_bytes(keys[0][:8], "big")
    assert block_hash(bytes(range(16))) == 0x0001020304050607
    with pytest.raises(ValueError):
        block_hash(b"short")


def test_media():
    assert l3_medium("file") == DISK and l3_medium("mooncake") == EXTERNAL and l3_medium("nixl") == EXTERNAL
    assert worker_media() == {L1: GPU, L2: CPU_PINNED} and worker_media(CPU) == {L1: CPU, L2: CPU_PINNED}
    assert KVEventsConfig().l1_medium == GPU     # consumers read GPU as the device tier, CPU as host
    with pytest.raises(ValueError, match="l1_medium"):
        KVEventsConfig(l1_medium="DISK")


def test_mapping_is_validated():
    with pytest.raises(ValueError):
        WireMapping.of(0, 8, {})
    with pytest.raises(ValueError):
        WireMapping.of(4, -1, {})
    with pytest.raises(ValueError):
        WireMapping.of(4, 8, {L1: "TAPE"})


# ---------------------------------------------------------------------------------- the tree's events

def tree_events():
    """A two-turn conversation on a tree with a window, a backup to L2, an L3 write and a tombstone."""
    t = RadixTree(PS, W)
    toks = list(range(100, 100 + 6 * PS))
    k = t.page_keys(toks)
    t.insert(k[:4], [0, 1, 2, 3], [None, None, 10, 11], now=1.0, tokens=toks[:4 * PS])
    r = t.insert(k, [0, 1, 2, 3, 4, 5], [None, None, None, None, 12, 13], now=2.0, tokens=toks)
    for n in r.node.path():
        t.tiers.set_l2(n, FULL, list(range(n.depth, n.end)))
        t.tiers.set_l3(n, FULL, True)
    t.check_integrity()
    stored = t.take_events()
    t.evict(SWA, L1, 2)   # the first turn's window: a tombstone
    t.check_integrity()
    return t, toks, k, stored, t.take_events()


def test_translation_groups_media_tokens_and_parents():
    t, toks, k, stored, removed = tree_events()
    m = WireMapping.of(PS, W * PS, worker_media())
    wire = to_wire(stored, m)
    ids = [block_hash(x) for x in k]
    assert {e.medium for e in wire} == {GPU, CPU_PINNED}            # L3 is not a worker's to publish
    assert all(isinstance(e, BlockStored) and e.block_size == PS for e in wire)
    for e in wire:
        first = ids.index(e.block_hashes[0])
        assert e.block_hashes == ids[first:first + len(e.block_hashes)]     # consecutive pages of the chain
        assert e.token_ids == toks[first * PS:(first + len(e.block_hashes)) * PS]
        assert e.parent_block_hash == (ids[first - 1] if first else None)
        if e.group_idx == 0:
            assert (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) == (FULL_ATTENTION, None)
        else:
            assert (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) == (1, SLIDING_WINDOW, W * PS)
    # Every page's full KV is stored in L1 exactly once, a parent before its child.
    full_l1 = [h for e in wire if e.group_idx == 0 and e.medium == GPU for h in e.block_hashes]
    assert full_l1 == ids
    seen: set = set()
    for e in wire:
        if e.group_idx == 0 and e.medium == GPU:
            assert e.parent_block_hash is None or e.parent_block_hash in seen
            seen.update(e.block_hashes)
    # The tombstone: a group-1 removal of the first turn's window, the full KV untouched.
    assert to_wire(removed, m) == [BlockRemoved(ids[2:4], GPU, 1)]


def test_translation_of_a_model_without_sliding_layers_and_of_the_storage_actor():
    t, toks, k, stored, removed = tree_events()
    full_only = to_wire(stored + removed, WireMapping.of(PS, 0, worker_media(CPU)))
    assert full_only and all(e.group_idx == 0 and e.medium in (CPU, CPU_PINNED) for e in full_only)
    l3 = to_wire(stored, WireMapping.of(PS, W * PS, {L3: DISK}))
    assert [h for e in l3 for h in e.block_hashes] == [block_hash(x) for x in k]
    assert all(e.medium == DISK for e in l3)


def test_removed_events_and_unknown_tokens():
    m = WireMapping.of(PS, 0, {L1: GPU})
    key = bytes(range(16))
    # An event from a tree that never learnt the tokens still goes out (consumers keyed by block id use it).
    assert to_wire([KVEvent("stored", L1, FULL, (key,))], m) == [
        BlockStored([block_hash(key)], None, [], PS, None, GPU, None, None, 0, FULL_ATTENTION, None)]
    assert to_wire([KVEvent("removed", L1, FULL, (key,))], m) == [BlockRemoved([block_hash(key)], GPU, 0)]


def test_config_validation():
    KVEventsConfig()
    for bad in (dict(enabled=1), dict(port=70000), dict(port=-1), dict(encoding="json"), dict(buffer_batches=0),
                dict(port=65000), dict(replay_port_offset=0), dict(host="")):
        with pytest.raises(ValueError):
            KVEventsConfig(**bad)


# vLLM's event spec as msgspec Structs (array_like=True, tag=True, omit_defaults=True; the tagged-map form is
# the same Structs with array_like=False), for the test below. Module level: msgspec resolves the
# annotations in the module's namespace.
try:
    import msgspec
except ImportError:   # not a dependency: the test says it skipped
    msgspec = None

if msgspec is not None:
    class SpecEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class SpecStored(SpecEvent, tag="BlockStored"):
        block_hashes: list[Union[int, bytes]]
        parent_block_hash: Optional[Union[int, bytes]]
        token_ids: list[int]
        block_size: int
        lora_id: Optional[int]
        medium: Optional[str]
        lora_name: Optional[str] = None
        extra_keys: Optional[list[Any]] = None
        group_idx: Optional[int] = None
        kv_cache_spec_kind: Optional[str] = None
        kv_cache_spec_sliding_window: Optional[int] = None

    class SpecRemoved(SpecEvent, tag="BlockRemoved"):
        block_hashes: list[Union[int, bytes]]
        medium: Optional[str]
        group_idx: Optional[int] = None

    class SpecCleared(SpecEvent, tag="AllBlocksCleared"):
        pass

    class SpecBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Union[SpecStored, SpecRemoved, SpecCleared]]
        data_parallel_rank: Optional[int] = None

    class SpecMapStored(SpecStored, array_like=False, tag="BlockStored"):
        pass

    class SpecMapRemoved(SpecRemoved, array_like=False, tag="BlockRemoved"):
        pass

    class SpecMapCleared(SpecCleared, array_like=False, tag="AllBlocksCleared"):
        pass

    class SpecMapBatch(SpecBatch):
        events: list[Union[SpecMapStored, SpecMapRemoved, SpecMapCleared]]


def test_vllm_spec_decodes_our_payloads():
    """Decoded with msgspec Structs declared as vLLM declares its events (array_like, tag, omit_defaults):
    vLLM itself is too large to install here, so this mirrors its spec (above), not its code."""
    if msgspec is None:
        pytest.skip("msgspec is not installed")
    pos = msgspec.msgpack.decode(encode_batch(EventBatch(1.0, EVENTS, 0), POSITIONAL), type=SpecBatch)
    tag = msgspec.msgpack.decode(encode_batch(EventBatch(1.0, EVENTS, 0), TAGGED), type=SpecMapBatch)
    for got in (pos, tag):
        s, s1, r, c = got.events
        assert s.block_hashes == STORED.block_hashes and s.token_ids == STORED.token_ids and s.group_idx == 0
        assert s1.kv_cache_spec_sliding_window == 8 and s1.parent_block_hash == 2**64 - 1
        assert (r.block_hashes, r.medium, r.group_idx) == ([3], CPU_PINNED, 1)
        assert type(c).__name__.endswith("Cleared") and got.data_parallel_rank == 0


def test_the_cluster_yaml_maps_the_section():
    from cluster.config import from_text, load_config
    cfg = from_text("kv_events:\n  port: 5557\n  encoding: positional\n  buffer_batches: 8\n")
    assert cfg.kv_events == KVEventsConfig(port=5557, encoding=POSITIONAL, buffer_batches=8)
    assert load_config().kv_events.enabled and load_config().kv_events.port == 0
    with pytest.raises(ValueError, match="kv_events"):
        from_text("kv_events:\n  encoding: json\n")
    with pytest.raises(ValueError, match="unknown keys"):
        from_text("kv_events:\n  prot: 1\n")
