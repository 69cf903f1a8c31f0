"""L3: the shared, persistent page store under the L2 host pools (see base.py for the contract).

``make_store(L3Config(...))`` opens the configured backend; the Mooncake and NIXL modules are imported
only when chosen, so the file store needs neither package.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from storage.l3.config import BACKENDS, L3Config, MooncakeConfig, NixlConfig

if TYPE_CHECKING:
    from storage.l3.base import L3Store

# The store contract (base.py) loads on first use: it needs numpy and xxhash (torch only once a page
# moves), and the router and the launcher unpickle this package's configs (cluster/config.py imports them)
# without either.
_FROM_BASE = ("HEADER_BYTES", "KEY_PREFIX", "STAT_KEYS", "L3Store", "l3_key")


def __getattr__(name: str):
    if name not in _FROM_BASE:
        raise AttributeError(f"module 'storage.l3' has no attribute {name!r}")
    value = getattr(importlib.import_module("storage.l3.base"), name)
    globals()[name] = value
    return value


__all__ = ["BACKENDS", "HEADER_BYTES", "KEY_PREFIX", "STAT_KEYS", "L3Config", "L3Store", "MooncakeConfig",
           "NixlConfig", "l3_key", "make_store"]


def make_store(cfg: L3Config) -> L3Store:
    if not isinstance(cfg, L3Config):
        raise ValueError(f"cfg must be an L3Config, got {type(cfg).__name__}")
    if cfg.backend == "file":
        from storage.l3.file import FileStore
        return FileStore(cfg)
    if cfg.backend == "mooncake":
        from storage.l3.mooncake import MooncakeStore
        return MooncakeStore(cfg)
    if cfg.backend == "nixl" and cfg.nixl.mode == "ucx":
        from storage.l3.nixl_ucx import NixlRemoteStore
        return NixlRemoteStore(cfg)
    if cfg.backend == "nixl":
        from storage.l3.nixl import NixlStore
        return NixlStore(cfg)
    raise ValueError(f"L3Config.backend must be one of {BACKENDS}, got {cfg.backend!r}")
