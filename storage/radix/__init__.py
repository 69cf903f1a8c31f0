"""The unified, SWA-aware, tiered radix tree of one worker (storage/radix/tree.py), and its parts: node.py
(nodes, results, KV events), walk.py (the walk), tiers.py (the data ledger), lru.py (eviction order),
locks.py (the lock table), check.py (the integrity check). Import the public names from here."""
from storage.radix.node import (COMPONENTS, FULL, L1, L2, L3, PAGE_TIERS, SWA, TIERS, Freed, InsertResult, KVEvent,
                                MatchResult, Node)
from storage.radix.tree import EVICTIONS, KEEP_CHECKPOINT, KEEP_POINT, OnEvict, RadixTree

__all__ = ["RadixTree", "OnEvict", "MatchResult", "InsertResult", "KVEvent", "Freed", "Node", "TIERS", "PAGE_TIERS",
           "L1", "L2", "L3", "FULL", "SWA", "COMPONENTS", "KEEP_CHECKPOINT", "KEEP_POINT", "EVICTIONS"]
