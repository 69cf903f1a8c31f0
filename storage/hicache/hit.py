"""What a request borrows from the cache: its ``PrefixHit`` (pages pinned by locks), and the ``Room``
question the scheduler answers before anything is loaded for it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from storage.copier import LayerFuture
from storage.sequence_keys import SequenceKeys
from storage.radix.node import Node

NO_TIERS = {"L1": 0, "L2": 0, "L3": 0}   # placeholder until a hit is complete (never mutated)


@dataclass(slots=True)   # one per request: slots make it smaller and its fields quicker to set
class PrefixHit:
    """A request's cached prefix: ``num_pages`` pages whose L1 pages it borrows (pinned by locks)."""

    node: Optional[Node] = None
    num_pages: int = 0
    full_pages: list[int] = field(default_factory=list)          # [num_pages] L1 full pages
    swa_pages: list[Optional[int]] = field(default_factory=list)  # [num_pages], None outside the window
    tokens_by_tier: dict[str, int] = field(default_factory=lambda: {"L1": 0, "L2": 0, "L3": 0})
    locked: tuple[str, ...] = ()
    waits: list[LayerFuture] = field(default_factory=list)  # loads to wait for, layer by layer
    # The request's page keys as far as the match needed them: hand them back to ``insert``.
    keys: Optional[SequenceKeys] = None
    deferred: bool = False   # locked, but its L2 pages wait for room in L1 (``resume``)
    unread: int = 0          # pages loaded for it that no forward has read yet (``mark_read``)


Room = Callable[[int, dict], bool]
"""``room(num_pages, needs)``: may a hit of ``num_pages`` pages load ``needs`` ({component: pages}) now?"""
