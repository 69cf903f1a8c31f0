"""Configuration of one worker's engine, and of its expert-parallel load balancing.

No torch at import: the ingress and the router receive these dataclasses inside the cluster's settings,
and a process that only unpickles them must not load torch (~2 s of its start). The properties that make
torch objects import it themselves."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from storage.config import HiCacheConfig, KVPoolConfig

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EplbConfig:
    """The rebalancer's knobs (cluster YAML ``eplb:``). A rebalance is due every ``interval_seconds`` or
    every ``interval_steps`` forward passes, whichever comes first (0 disables that trigger); it uses the
    loads of the last ``window`` intervals and is applied only when the current balancedness is under
    ``threshold`` and the new placement improves on it.

    The engine reads the slot layout (``num_ranks`` x (E + ``num_redundant_experts``) / ``num_ranks``
    slots) and ``dispatch`` ("auto", "torch", "deep_ep"); the rebalancer reads the rest: it collects the
    workers' counters every ``collect_seconds`` (one window interval) and acts on its own schedule only
    when ``auto`` (``strata rebalance`` triggers it by hand either way). ``migration_aware``: relabel the
    new placement's ranks and slots to keep experts where they are (``align_placement``: the same
    balancedness, fewer weights moved); false applies the placement algorithm's plain output."""
    num_redundant_experts: int = 0
    num_ranks: int = 1
    num_groups: int = 1
    num_nodes: int = 1
    window: int = 10
    interval_seconds: float = 60.0
    interval_steps: int = 0
    threshold: float = 0.9
    auto: bool = True
    collect_seconds: float = 1.0
    dispatch: str = "auto"
    migration_aware: bool = True

    def __post_init__(self) -> None:
        for name, lo in (("num_redundant_experts", 0), ("num_ranks", 1), ("num_groups", 1), ("num_nodes", 1),
                         ("window", 1), ("interval_steps", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"EplbConfig.{name} must be an int >= {lo}, got {v!r}")
        if self.num_ranks % self.num_nodes:
            raise ValueError(f"EplbConfig.num_nodes ({self.num_nodes}) must divide num_ranks ({self.num_ranks})")
        if self.num_redundant_experts % self.num_ranks:
            raise ValueError(f"EplbConfig.num_redundant_experts ({self.num_redundant_experts}) must be a "
                             f"multiple of num_ranks ({self.num_ranks})")
        if not isinstance(self.interval_seconds, (int, float)) or not self.interval_seconds >= 0:
            raise ValueError(f"EplbConfig.interval_seconds must be >= 0, got {self.interval_seconds!r}")
        if self.interval_seconds == 0 and self.interval_steps == 0:
            raise ValueError("EplbConfig.interval_seconds and interval_steps are both 0: nothing would trigger")
        if not isinstance(self.threshold, (int, float)) or not 0 < self.threshold <= 1:
            raise ValueError(f"EplbConfig.threshold must be in (0, 1], got {self.threshold!r}")
        if not isinstance(self.auto, bool):
            raise ValueError(f"EplbConfig.auto must be a bool, got {self.auto!r}")
        if isinstance(self.collect_seconds, bool) or not isinstance(self.collect_seconds, (int, float)) \
                or not self.collect_seconds > 0:
            raise ValueError(f"EplbConfig.collect_seconds must be > 0, got {self.collect_seconds!r}")
        if not isinstance(self.migration_aware, bool):
            raise ValueError(f"EplbConfig.migration_aware must be a bool, got {self.migration_aware!r}")
        if self.dispatch not in ("auto", "torch", "deep_ep", "deep_ep_ll"):
            raise ValueError(f"EplbConfig.dispatch must be auto, torch, deep_ep or deep_ep_ll, got {self.dispatch!r}")

    def num_replicas(self, num_logical: int) -> int:
        return num_logical + self.num_redundant_experts

    def is_due(self, now: float, step: int, last_time: float, last_step: int) -> bool:
        """Whether a rebalance is due at time ``now`` (seconds) and forward pass ``step``, given when the
        last one happened."""
        return ((self.interval_seconds > 0 and now - last_time >= self.interval_seconds)
                or (self.interval_steps > 0 and step - last_step >= self.interval_steps))



@dataclass(frozen=True)
class EngineConfig:
    model: str = "strata-tiny"
    page_size: int = 16
    num_pages: int = 1024
    swa_full_ratio: float = 0.5
    max_batch_tokens: int = 512          # tokens per step (decode tokens + prefill chunks)
    chunk_size: int = 0                  # longest prefill chunk; 0 means max_batch_tokens
    max_running_requests: int = 64
    device: str = "auto"                 # auto: cuda when present, else cpu
    dtype: str = "float32"
    seed: int = 0                        # seeds the sampler of requests without their own seed
    poison_kv: bool = False              # debug: fill fresh L1 pages with garbage (tests)
    debug_integrity: bool = False        # debug: check every invariant after each step (AsyncEngine)
    torch_threads: int = 0               # intra-op threads for this process; 0 keeps torch's default
    enable_prefix_cache: bool = False
    prefix_eviction: str = "slru"        # slru | lru (slru: never-reused pages go first; storage/radix/lru.py)
    # Tokens between kept SWA windows of a prompt (checkpoints, where a later prompt may branch off): 0 is
    # one window kept per four windows of prompt (KVGeometry.checkpoint_pages); rounded down to pages.
    swa_checkpoint_interval: int = 0
    hicache: HiCacheConfig | None = None  # the L2 host tier; None keeps the cache in L1 only
    eplb: EplbConfig | None = None       # expert slots + rebalancer knobs; None: logical experts only

    def __post_init__(self) -> None:
        KVPoolConfig(self.page_size, self.num_pages, self.swa_full_ratio)  # validates those fields
        for name in ("max_batch_tokens", "max_running_requests"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 0:
            raise ValueError(f"chunk_size must be an int >= 0, got {self.chunk_size!r}")
        if isinstance(self.torch_threads, bool) or not isinstance(self.torch_threads, int) or self.torch_threads < 0:
            raise ValueError(f"torch_threads must be an int >= 0, got {self.torch_threads!r}")
        if isinstance(self.swa_checkpoint_interval, bool) or not isinstance(self.swa_checkpoint_interval, int) \
                or self.swa_checkpoint_interval < 0:
            raise ValueError(f"swa_checkpoint_interval must be an int >= 0 (tokens; 0: four windows), "
                             f"got {self.swa_checkpoint_interval!r}")
        if not isinstance(self.debug_integrity, bool):
            raise ValueError(f"debug_integrity must be a bool, got {self.debug_integrity!r}")
        if self.prefix_eviction not in ("lru", "slru"):
            raise ValueError(f"prefix_eviction must be lru or slru, got {self.prefix_eviction!r}")
        if self.hicache is not None and not isinstance(self.hicache, HiCacheConfig):
            raise ValueError("hicache must be a HiCacheConfig")
        if self.hicache is not None and not self.enable_prefix_cache:
            raise ValueError("hicache needs enable_prefix_cache=True")
        if self.eplb is not None and not isinstance(self.eplb, EplbConfig):
            raise ValueError("eplb must be an EplbConfig")
        if self.dtype not in _DTYPES and self.dtype != "auto":
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.device != "auto":
            import torch
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"device {self.device!r} is not a torch device: {e}") from None

    @property
    def pool(self) -> KVPoolConfig:
        return KVPoolConfig(self.page_size, self.num_pages, self.swa_full_ratio)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch
        if self.dtype == "auto":
            raise ValueError("dtype auto is resolved from the checkpoint (Engine resolves it at load)")
        return getattr(torch, self.dtype)

    def resolved(self, checkpoint_dtype: str) -> "EngineConfig":
        """``dtype: auto`` -> the checkpoint's ``torch_dtype`` (float32 when it names none of ours)."""
        if self.dtype != "auto":
            return self
        return dataclasses.replace(self, dtype=checkpoint_dtype if checkpoint_dtype in _DTYPES else "float32")

    @property
    def torch_device(self) -> torch.device:
        import torch
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def effective_chunk_size(self) -> int:
        return min(self.chunk_size or self.max_batch_tokens, self.max_batch_tokens)


def model_id(model_path, mc, cfg: EngineConfig) -> str:
    """The L3 namespace of an engine's pages: model, geometry, dtype, page size and L2 layout (the router
    and the storage actor compute it without building an engine). ``model_path``: the checkpoint's
    directory (a Path); ``mc``: its ModelConfig."""
    layout = cfg.hicache.layout if cfg.hicache is not None else "-"
    return (f"{model_path.name}/L{mc.num_hidden_layers}h{mc.hidden_size}kv{mc.num_key_value_heads}"
            f"d{mc.head_dim}/{cfg.dtype}/p{cfg.page_size}/{layout}")
