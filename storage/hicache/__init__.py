"""The tier controller (``HiCache``) and what it hands out. The modules, one way down:

    cache.py      HiCache: match / resume / insert / evict / prefetch / check_integrity (the public API)
    no_cache.py   NoCache: the cache of an engine without a prefix cache (keeps nothing)
    write.py      write policies as strategies        l1.py        room in L1
    host_tier.py  L2 (HostTier)                        l3_tier.py   L3 (L3Tier) over prefetcher.py
    loadback.py   L2 -> L1 of a hit                    install.py   what an L3 prefetch brought -> tree
    prefetch.py   prefetch policies, cuts, Prefetch    tier.py      the tier interface, NoTier
    hit.py        PrefixHit, Room
"""
from storage.hicache.cache import HiCache
from storage.hicache.hit import PrefixHit, Room
from storage.hicache.host_tier import HostTier
from storage.hicache.no_cache import NoCache
from storage.hicache.prefetch import prefetch_ready, usable_end
from storage.kernels_path import transfer  # noqa: F401  (tests slow the copies down through it)

__all__ = ["HiCache", "NoCache", "PrefixHit", "Room", "HostTier", "prefetch_ready", "usable_end"]
