"""Configuration of one worker's engine."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.eplb import EplbConfig
from storage.config import HiCacheConfig, KVPoolConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"device {self.device!r} is not a torch device: {e}") from None

    @property
    def pool(self) -> KVPoolConfig:
        return KVPoolConfig(self.page_size, self.num_pages, self.swa_full_ratio)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            raise ValueError("dtype auto is resolved from the checkpoint (Engine resolves it at load)")
        return _DTYPES[self.dtype]

    def resolved(self, checkpoint_dtype: str) -> "EngineConfig":
        """``dtype: auto`` -> the checkpoint's ``torch_dtype`` (float32 when it names none of ours)."""
        if self.dtype != "auto":
            return self
        return dataclasses.replace(self, dtype=checkpoint_dtype if checkpoint_dtype in _DTYPES else "float32")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def effective_chunk_size(self) -> int:
        return min(self.chunk_size or self.max_batch_tokens, self.max_batch_tokens)
