"""Installing what an L3 prefetch brought: its host pages become the tree's L2 copies (L3 flag set) and
are loaded into fresh L1 pages, extending a locked hit. Given the tree, the L1 pools and room in them,
and the L2 tier the host pages belong to."""
from __future__ import annotations

from typing import NamedTuple, Optional

from storage.copier import wait_copies
from storage.hicache.hit import PrefixHit
from storage.hicache.l1 import L1Space
from storage.hicache.prefetch import Fetched
from storage.kernels_path import transfer
from storage.pools import FULL, SWA, KVPools
from storage.radix import RadixTree
from storage.radix.node import Node


class Installed(NamedTuple):
    node: Node                        # the hit's new last node (m pages deep)
    full_pages: list[int]             # [m] L1 full pages along its path
    swa_pages: list[Optional[int]]    # [m] L1 SWA pages from the window's start, None before


def install(tree: RadixTree, pools: KVPools, l1: L1Space, l2, hit: PrefixHit, page_keys: list[bytes],
            got: Fetched, now: float) -> Optional[Installed]:
    """Put ``got`` (full host pages [m0, m), SWA host pages [swa_lo, m); ``m0`` = the hit's pages) into
    the tree past ``hit``. The host pages belong to this call: used or freed. None when L1 has no room
    (the hit stays as it was)."""
    m0, m, swa_lo, h_full, h_swa = got
    n_swa = len(h_swa)
    if not (l1.room(FULL, m - m0) and (not n_swa or l1.room(SWA, n_swa))):
        l2.free(FULL, h_full)
        l2.free(SWA, h_swa)
        return None
    full_host, swa_host = l2.pool(FULL), l2.pool(SWA)
    l1_full = pools.full.allocator.alloc(m - m0)
    l1_swa = pools.swa.allocator.alloc(n_swa) if n_swa else []
    transfer.l2_to_l1(pools.full.flat(), full_host.data, full_host.layout, h_full, l1_full, check=False)
    if n_swa:
        transfer.l2_to_l1(pools.swa.flat(), swa_host.data, swa_host.layout, h_swa, l1_swa, check=False)
    wait_copies(pools.full.kv)   # host pages read here may be freed below and refilled by the prefetcher
    # Pages before m0 keep the tree's own L1 pages (never reported as duplicates); SWA pages the tree
    # does not hold in L1 below m0 are simply not offered.
    swa_all: list[Optional[int]] = list(hit.swa_pages) + [None] * (m - m0)
    for i in range(swa_lo, m):
        if i >= m0 or swa_all[i] is None:
            swa_all[i] = l1_swa[i - swa_lo]   # below m0: the tree lacked it in L1, adopt the L3 copy
    used_swa = {swa_all[i] for i in range(swa_lo, m)}
    spare_swa = [p for p in l1_swa if p not in used_swa]
    res = tree.insert(page_keys[:m], hit.full_pages + l1_full, swa_all, now=now)
    l1.free(res.free_full, res.free_swa + spare_swa)
    # Record the L2 copies (the host pages just read) and the L3 flag on the nodes past m0; a node
    # that meanwhile got its own L2 copy keeps it and the prefetched page goes back.
    x, spare_full = res.node, []
    while x is not None and x.parent is not None and x.depth >= m0:
        part = h_full[x.depth - m0:x.end - m0]
        if x.l2[FULL] is None:
            tree.set_l2(x, FULL, part)
        else:
            spare_full += part
        if not x.l3[FULL]:
            tree.set_l3(x, FULL, True)   # setting the flag never frees anything
        x = x.parent
    l2.free(FULL, spare_full)
    x, used_h = res.node, set()
    while n_swa and x is not None and x.parent is not None and x.end > swa_lo:
        if x.depth >= swa_lo and x.l2[SWA] is None and x.l1[SWA] is not None:
            part = h_swa[x.depth - swa_lo:x.end - swa_lo]
            tree.set_l2(x, SWA, part)
            used_h.update(part)
            if not x.l3[SWA]:
                tree.set_l3(x, SWA, True)
        x = x.parent
    l2.free(SWA, [p for p in h_swa if p not in used_h])
    path = res.node.path()
    swa_pages: list[Optional[int]] = [None] * m
    for nd in path:
        if nd.l1[SWA] is not None:
            for i in range(nd.num_pages):
                if nd.depth + i >= swa_lo:
                    swa_pages[nd.depth + i] = nd.l1[SWA][i]
    return Installed(res.node, [p for nd in path for p in nd.l1[FULL]], swa_pages)
