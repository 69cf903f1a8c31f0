"""One YAML describes the cluster. Each room owns its dataclass (EngineConfig, HiCacheConfig,
RouterConfig); this module only composes them and maps YAML onto them one to one."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from actors.cpu_binding import MODES as CPU_BINDING_MODES
from actors.routing import RouterConfig
from actors.storage import StorageConfig
from cluster.placement import ROLES as PLACED_ROLES, PlacementConfig, RolePlacement
from engine.config import EngineConfig, EplbConfig
from storage.config import HiCacheConfig
from storage.kv_events import KVEventsConfig
from storage.l3.config import L3Config, MooncakeConfig, NixlConfig
from storage.transfer.config import TransferConfig

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "default.yaml"


@dataclass(frozen=True)
class WorkersConfig:
    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    num_cpus: float = 0.5          # Ray logical CPUs per worker actor (declare fractions on small boxes)
    num_gpus: float = 0.0
    # Each worker also asks Ray for 1 unit of the custom resource "strata_<role>", so prefill and decode
    # workers land on nodes that declare it (the prefill/decode worker groups of manifests/).
    role_resources: bool = False
    # > 1: each (colocated) worker serves through an expert-parallel group of ep_size rank processes on
    # its node (actors/ep_host.py), each asking num_cpus / num_gpus; engine.eplb.num_ranks must match.
    ep_size: int = 1
    # auto: workers whose engines run on the CPU with torch_threads set, two or more on a machine and no
    # more than its cores, keep their processes on cores of their own (actors/cpu_binding.py); off: the OS
    # places them.
    cpu_binding: str = "auto"

    def __post_init__(self) -> None:
        if self.cpu_binding not in CPU_BINDING_MODES:
            raise ValueError(f"workers.cpu_binding must be one of {CPU_BINDING_MODES}, got {self.cpu_binding!r}")
        if isinstance(self.ep_size, bool) or not isinstance(self.ep_size, int) or self.ep_size < 1:
            raise ValueError(f"workers.ep_size must be an int >= 1, got {self.ep_size!r}")
        if not isinstance(self.role_resources, bool):
            raise ValueError(f"workers.role_resources must be a bool, got {self.role_resources!r}")
        for name in ("prefill", "decode", "colocated"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"workers.{name} must be an int >= 0, got {v!r}")
        if self.colocated == 0 and (self.prefill == 0 or self.decode == 0):
            raise ValueError("workers: need prefill >= 1 and decode >= 1, or colocated >= 1")
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("workers: colocated workers cannot be mixed with prefill/decode workers")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError("workers.num_cpus and workers.num_gpus must be >= 0")

    def role_resource(self, role: str) -> dict[str, float]:
        return {f"strata_{role}": 1.0} if self.role_resources else {}

    def bundle(self, role: str) -> dict[str, float]:
        """The placement-group bundle of one worker of ``role``."""
        return {"CPU": self.num_cpus, **({"GPU": self.num_gpus} if self.num_gpus else {}),
                **self.role_resource(role)}


FRONTS = ("haproxy", "serve_proxy")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "strata-tiny"
    request_timeout: float = 120.0
    max_inflight: int = 256
    num_cpus: float = 0.2
    # On SIGINT/SIGTERM, how long running generations may take to finish before the cluster stops anyway.
    drain_timeout: float = 30.0
    # What listens on host:port. haproxy: Ray's bundled HAProxy forwards each connection to the ingress
    # replica, which serves HTTP itself (Serve's "direct ingress"), ~5 ms less per request than serve_proxy,
    # Serve's Python HTTP proxy, which hands each request to the replica over Ray. Ray reads the choice from
    # the environment of its processes, so it applies to the clusters launch starts (cluster/launch.py
    # front_env); on one started otherwise, its nodes' environment decides (manifests/base/raycluster.yaml).
    front: str = "haproxy"
    # Ray Serve's access line per request in the ingress replica's log (method, route, status, latency). Off:
    # each line is written to the replica's log file and to its stderr, which Ray's log monitor then reads and
    # publishes; ~0.35 ms of CPU per request in all on a 2-core machine (bench/overhead.py). Request counts
    # and latencies stay in /metrics and in Ray Serve's own metrics.
    access_log: bool = False

    def __post_init__(self) -> None:
        if self.front not in FRONTS:
            raise ValueError(f"server.front must be one of {', '.join(FRONTS)}, got {self.front!r}")
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"server.port must be in 1..65535, got {self.port!r}")
        if self.max_inflight < 1 or self.request_timeout <= 0:
            raise ValueError("server.max_inflight must be >= 1 and server.request_timeout > 0")
        if not isinstance(self.drain_timeout, (int, float)) or self.drain_timeout < 0:
            raise ValueError(f"server.drain_timeout must be a number >= 0, got {self.drain_timeout!r}")
        if not isinstance(self.access_log, bool):
            raise ValueError(f"server.access_log must be true or false, got {self.access_log!r}")


IF_EXISTS = ("adopt", "replace", "fail")


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None      # None: start a local cluster (strata serve); "auto" inside ray job submit
    num_cpus: int = 8               # logical CPUs of a local cluster
    namespace: str = "strata"
    # A launch that finds strata's named actors already running in the namespace: adopt (keep them and a
    # healthy Serve app), replace (drain and tear them down, deploy anew) or fail. See cluster/lifecycle.py.
    if_exists: str = "adopt"

    def __post_init__(self) -> None:
        if not isinstance(self.num_cpus, int) or self.num_cpus < 1:
            raise ValueError(f"ray.num_cpus must be a positive int, got {self.num_cpus!r}")
        if self.if_exists not in IF_EXISTS:
            raise ValueError(f"ray.if_exists must be one of {', '.join(IF_EXISTS)}, got {self.if_exists!r}")


@dataclass(frozen=True)
class ClusterConfig:
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(enable_prefix_cache=True,
                                                                       hicache=HiCacheConfig()))
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)   # the L3 StorageActor (actors/storage.py)
    placement: PlacementConfig = field(default_factory=PlacementConfig)   # which node runs what (cluster/placement.py)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)   # the KV-event wire (storage/kv_events/)

    def __post_init__(self) -> None:
        check_ep(self.workers, self.engine)
        if self.router.policy == "prefix" and not self.kv_events.enabled and self.engine.enable_prefix_cache:
            # The router's index reads the workers' KV-event streams (actors/router.py): without them it
            # would route by load alone while claiming prefix routing.
            raise ValueError("kv_events.enabled: false leaves router.policy 'prefix' without the workers' cache "
                             "state (the router reads their KV-event streams); enable kv_events or set "
                             "router.policy: round_robin")

    def check_model(self, num_experts: int) -> None:
        """What needs the checkpoint (launch calls it before creating any actor): an EP group shards
        the experts of an MoE model, ep_size ranks x (experts + redundant) / ep_size slots each."""
        n = self.workers.ep_size
        if n > 1 and num_experts == 0:
            raise ValueError(f"workers.ep_size is {n} but model {self.engine.model!r} has no MoE layers")
        if n > 1 and num_experts % n:
            raise ValueError(f"workers.ep_size ({n}) must divide the model's {num_experts} experts "
                             f"(each rank holds (experts + num_redundant_experts) / ep_size slots)")


def check_ep(w: WorkersConfig, e: EngineConfig) -> None:
    """workers.ep_size against the engine: what an EP group cannot serve is refused here, not at the
    first request."""
    n = w.ep_size
    if n == 1:
        return
    if e.eplb is None or e.eplb.num_ranks != n:
        got = "no engine.eplb" if e.eplb is None else f"engine.eplb.num_ranks {e.eplb.num_ranks}"
        raise ValueError(f"workers.ep_size ({n}) needs engine.eplb with num_ranks: {n} (got {got})")
    if e.hicache is not None:
        raise ValueError(f"workers.ep_size ({n}): set engine.hicache to null (an L2 load-back would fill only "
                         "the leader's KV pools; the other ranks hold the same KV only when they computed it)")
    if w.prefill or w.decode:
        raise ValueError(f"workers.ep_size ({n}) needs colocated workers (prefill: 0, decode: 0): KV imported "
                         "from a prefill worker would land only in the leader's pools")


def _build(cls, data: Any, path: str):
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(fields)
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    kwargs = {}
    for k, v in data.items():
        sub = _NESTED.get((cls, k))
        kwargs[k] = _build(sub, v, f"{path}.{k}") if sub is not None and v is not None else v
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


_NESTED = {(HiCacheConfig, "l3"): L3Config, (L3Config, "mooncake"): MooncakeConfig,
           (L3Config, "nixl"): NixlConfig, (ClusterConfig, "engine"): EngineConfig, (ClusterConfig, "workers"): WorkersConfig,
           (ClusterConfig, "router"): RouterConfig, (ClusterConfig, "server"): ServerConfig,
           (ClusterConfig, "ray"): RayConfig, (EngineConfig, "hicache"): HiCacheConfig,
           (ClusterConfig, "transfer"): TransferConfig, (EngineConfig, "eplb"): EplbConfig,
           (ClusterConfig, "storage"): StorageConfig, (ClusterConfig, "placement"): PlacementConfig,
           (ClusterConfig, "kv_events"): KVEventsConfig,
           **{(PlacementConfig, r): RolePlacement for r in PLACED_ROLES}}


def from_dict(data: dict) -> ClusterConfig:
    return _build(ClusterConfig, data, "config")


def load_config(path: str | Path | None = None) -> ClusterConfig:
    p = Path(path) if path else DEFAULT_CONFIG
    if not p.is_file():
        raise ValueError(f"config: no such file {p}")
    return from_text(p.read_text())


def from_text(text: str) -> ClusterConfig:
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"config: invalid YAML: {e}") from None
    return from_dict(data)


def with_model(cfg: ClusterConfig, model: str, served_name: str | None = None) -> ClusterConfig:
    """``cfg`` serving ``model`` (strata-tiny or a checkpoint directory), under ``served_name`` (default:
    the model argument as given, as vLLM and SGLang name it)."""
    if not model:
        raise ValueError("--model: empty")
    engine = dataclasses.replace(cfg.engine, model=model)
    server = dataclasses.replace(cfg.server, model_name=served_name or model)
    return dataclasses.replace(cfg, engine=engine, server=server)
