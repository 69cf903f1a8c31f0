"""Configuration of the L3 tier: which store backs it and how to reach it.

One ``L3Config`` per worker (or per storage actor). Only the section of the chosen backend is read, but
every section is validated, so a typo in an unused section still fails at load time rather than on the
day someone switches backend. Nested sections may be given as dicts (the YAML loader's shape).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

BACKENDS = ("file", "mooncake", "nixl")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
MOONCAKE_PROTOCOLS = ("tcp", "rdma")
NIXL_MODES = ("posix", "ucx")

GiB = 1 << 30
MiB = 1 << 20


def _int(obj, name: str, lo: int) -> None:
    v = getattr(obj, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{type(obj).__name__}.{name} must be an int >= {lo}, got {v!r}")


def _pos(obj, name: str) -> None:
    v = getattr(obj, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ValueError(f"{type(obj).__name__}.{name} must be a positive number, got {v!r}")


def _str(obj, name: str, allow_empty: bool = False) -> None:
    v = getattr(obj, name)
    if not isinstance(v, str) or (not v and not allow_empty):
        raise ValueError(f"{type(obj).__name__}.{name} must be a {'' if allow_empty else 'non-empty '}str, "
                         f"got {v!r}")


def _host_port(obj, name: str) -> None:
    v = getattr(obj, name)
    host, sep, port = v.rpartition(":") if isinstance(v, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{type(obj).__name__}.{name} must be 'host:port', got {v!r}")


def _section(obj, name: str, cls) -> None:
    """Accept a dict for a nested section (YAML) and turn it into the frozen dataclass."""
    v = getattr(obj, name)
    if isinstance(v, dict):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(v) - known)
        if unknown:
            raise ValueError(f"{type(obj).__name__}.{name}: unknown field(s) {unknown}")
        v = cls(**v)
        object.__setattr__(obj, name, v)
    if not isinstance(v, cls):
        raise ValueError(f"{type(obj).__name__}.{name} must be a {cls.__name__} or dict, got {type(v).__name__}")


@dataclass(frozen=True)
class MooncakeConfig:
    """A Mooncake store client. ``metadata_server`` is ``P2PHANDSHAKE`` (peers exchange transfer-engine
    metadata directly, no extra service) or the URL of an HTTP metadata server such as the one
    ``mooncake_master --enable_http_metadata_server`` embeds. ``segment_bytes`` is the memory this client
    contributes to the cluster-wide pool (0: the L3 ``capacity_bytes``); in a cluster the storage actor's
    client always contributes ``capacity_bytes`` and holds the pages, so a worker's own can stay small."""

    master_addr: str = "127.0.0.1:50051"
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    rdma_devices: str = ""
    segment_bytes: int = 0
    local_buffer_bytes: int = 16 * MiB
    replicas: int = 1
    preferred_segment: str = ""     # place new objects in this client's segment (the storage actor's), "" any
    op_timeout_s: float = 5.0       # a batch call that takes longer is a miss / a failed set
    retry_after_s: float = 2.0      # after a timeout or an RPC failure, skip calls for this long
    setup_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        _host_port(self, "master_addr")
        _str(self, "metadata_server")
        _str(self, "local_hostname")
        if self.protocol not in MOONCAKE_PROTOCOLS:
            raise ValueError(f"MooncakeConfig.protocol must be one of {MOONCAKE_PROTOCOLS}, got {self.protocol!r}")
        _str(self, "rdma_devices", allow_empty=True)
        _int(self, "segment_bytes", 0)
        _int(self, "local_buffer_bytes", 1 * MiB)
        _int(self, "replicas", 1)
        _str(self, "preferred_segment", allow_empty=True)
        for name in ("op_timeout_s", "retry_after_s", "setup_timeout_s"):
            _pos(self, name)


@dataclass(frozen=True)
class NixlConfig:
    """A NIXL agent. ``posix``: pages move between registered host memory and files (the L3 ``path``)
    with the POSIX backend, whose plugin gets ``backend_params`` verbatim (e.g. ``{"use_uring": "true"}``).
    ``ucx``: pages move by one-sided UCX READ/WRITE into the memory of a slab server process at
    ``remote_addr`` (``python -m storage.l3.nixl_ucx``), which shares ``authkey`` with its clients."""

    mode: str = "posix"
    agent_name: str = ""            # "" -> unique per process
    backend_params: tuple[tuple[str, str], ...] = ()
    remote_addr: str = ""
    authkey: str = "strata-l3"
    op_timeout_s: float = 10.0
    retry_after_s: float = 2.0      # ucx: after a timeout or a lost server, skip calls for this long

    def __post_init__(self) -> None:
        if self.mode not in NIXL_MODES:
            raise ValueError(f"NixlConfig.mode must be one of {NIXL_MODES}, got {self.mode!r}")
        _str(self, "agent_name", allow_empty=True)
        params = self.backend_params
        if isinstance(params, dict):
            params = tuple(sorted(params.items()))
            object.__setattr__(self, "backend_params", params)
        if not all(isinstance(p, tuple) and len(p) == 2 and all(isinstance(s, str) for s in p) for p in params):
            raise ValueError(f"NixlConfig.backend_params must map str to str, got {self.backend_params!r}")
        if self.mode == "ucx":
            _host_port(self, "remote_addr")
        _str(self, "authkey")
        _pos(self, "op_timeout_s")
        _pos(self, "retry_after_s")


@dataclass(frozen=True)
class L3Config:
    """The L3 store. ``path`` is the directory of the ``file`` and ``nixl`` backends ("" -> ``l3`` under
    ``$STRATA_HOME`` or ``~/.cache/strata``). ``capacity_bytes`` caps what the store keeps: the file
    backends evict least-recently-used pages past it, Mooncake sizes this client's segment by it."""

    backend: str = "file"
    path: str = ""
    capacity_bytes: int = 16 * GiB
    max_page_bytes: int = 256 * MiB   # a bigger "page" is a caller bug, not a KV page
    io_threads: int = 0               # parallel file reads/writes of a batch of >= 1 MiB (file.py); 0 -> min(4, CPUs)
    fsync: bool = False               # a cache: a page lost to a crash is a miss, the checksum catches torn ones
    rescan_interval_s: float = 10.0   # how stale a file store's view of other processes' writes may get
    evict: bool = True                # False: another process (the StorageActor) evicts; a set past the cap fails
    # When a request whose prefix continues in L3 may start (storage/hicache/prefetch.py): best_effort at
    # the next schedule with what has arrived, wait_complete once everything has, timeout when everything
    # has or ``prefetch_timeout_base + prefetch_timeout_per_ki_token * tokens / 1024`` seconds have passed.
    prefetch_policy: str = "timeout"
    prefetch_timeout_base: float = 1.0
    prefetch_timeout_per_ki_token: float = 0.25
    prefetch_batch_pages: int = 16    # pages per batch_get: what has arrived grows by this much at a time
    # A request looks in L3 only for at least this many tokens past what L1/L2 hold (SGLang's HiCache
    # prefetch threshold, 256 by default there too): a shorter run is cheaper to recompute than to wait a
    # store lookup for, and every lookup holds its request back at least one schedule.
    prefetch_min_tokens: int = 256
    mooncake: MooncakeConfig = field(default_factory=MooncakeConfig)
    nixl: NixlConfig = field(default_factory=NixlConfig)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"L3Config.backend must be one of {BACKENDS}, got {self.backend!r}")
        _str(self, "path", allow_empty=True)
        _int(self, "capacity_bytes", 1)
        _int(self, "max_page_bytes", 1)
        _int(self, "io_threads", 0)
        if not isinstance(self.fsync, bool):
            raise ValueError(f"L3Config.fsync must be a bool, got {self.fsync!r}")
        _pos(self, "rescan_interval_s")
        if not isinstance(self.evict, bool):
            raise ValueError(f"L3Config.evict must be a bool, got {self.evict!r}")
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"L3Config.prefetch_policy must be one of {PREFETCH_POLICIES}, got {self.prefetch_policy!r}")
        _pos(self, "prefetch_timeout_base")
        v = self.prefetch_timeout_per_ki_token
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"L3Config.prefetch_timeout_per_ki_token must be a number >= 0, got {v!r}")
        _int(self, "prefetch_batch_pages", 1)
        _int(self, "prefetch_min_tokens", 0)
        _section(self, "mooncake", MooncakeConfig)
        _section(self, "nixl", NixlConfig)

    def prefetch_deadline(self, started: float, tokens: int) -> float:
        """When the ``timeout`` policy lets a request go, for a fetch of ``tokens`` tokens."""
        return started + self.prefetch_timeout_base + self.prefetch_timeout_per_ki_token * tokens / 1024

    def flush_scope(self) -> str:
        """What ``POST /flush_cache`` removes from this store (storage/l3: ``clear_model``)."""
        if self.backend == "mooncake":
            return ("this model's namespace (keys strata/<model_id>/...) on the Mooncake master; other keys "
                    "of a shared master are kept")
        if self.backend == "nixl" and self.nixl.mode == "ucx":
            return f"every page of the slab server at {self.nixl.remote_addr} (this cluster's own)"
        return f"every page under {self.resolved_path()} (the cluster's own directory)"

    def resolved_path(self) -> str:
        if self.path:
            return os.path.abspath(os.path.expanduser(self.path))
        home = os.environ.get("STRATA_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "strata")
        return os.path.join(home, "l3")
