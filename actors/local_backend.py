"""A Backend over one in-process engine (engine/async_engine.py), without Ray: the whole HTTP frontend
on a real engine in one process. The frontend's fast tests serve from it, and a single-process server
can (``build_app(LocalBackend.from_pretrained(...))``)."""
from __future__ import annotations

from typing import AsyncGenerator

from actors.served import Served, ServedStream
from engine.async_engine import AsyncEngine, StreamItem
from engine.engine import Engine
from engine.model.generation_config import sampling_defaults
from engine.sampling import SamplingParams

WORKER = "local"
SERVED = Served(WORKER)   # one engine: it prefills and decodes, and nobody predicts its hits


class LocalBackend:
    def __init__(self, engine: Engine, model_name: str = "strata-tiny") -> None:
        if engine.tokenizer is None:
            raise ValueError("model: the HTTP API needs a tokenizer.json in the checkpoint")
        self.core = AsyncEngine(engine, name="local")
        self.model_name, self.model_path = model_name, str(engine.cfg.model)
        self.vocab_size = engine.model_config.vocab_size
        self.max_context = engine.max_context
        self.tokenizer = engine.tokenizer
        self.sampling_defaults = sampling_defaults(engine.model_path)
        hc = engine.cfg.hicache
        self.l3_backend = hc.l3.backend if hc is not None and hc.l3 is not None else None   # cache reports

    @classmethod
    def from_pretrained(cls, model: str = "strata-tiny", model_name: str | None = None, **kw) -> "LocalBackend":
        return cls(Engine.from_pretrained(model, **kw), model_name or model)

    def stream(self, ids: list[int], params: SamplingParams, avoid: tuple[str, ...] = (),
               pin: Served | None = None, whole: bool = False) -> ServedStream:
        """(``whole`` changes nothing here: in one process, an item per step costs no message.)"""
        return ServedStream(self._serve(ids, params))

    async def _serve(self, ids: list[int], params: SamplingParams) -> AsyncGenerator[Served | StreamItem, None]:
        yield SERVED
        async for item in self.core.generate(ids, params):
            yield item

    async def health(self) -> dict:
        return {"ok": True, "workers": [WORKER]}

    async def flush_cache(self) -> dict:
        """One engine: its flush is the whole flush, L3 included (no other worker shares its store)."""
        res = await self.core.flush_cache(l3=True)
        if not res["flushed"]:
            return {"flushed": False, "reason": "busy: nothing was flushed (retry when idle)",
                    "busy": {WORKER: res["reason"]}, "workers": {}}
        store, error = res.pop("L3_store"), res.pop("L3_store_error", None)
        l3 = self.core.engine.cfg.hicache.l3 if self.core.engine.cfg.hicache is not None else None
        return {"flushed": error is None, "workers": {WORKER: res},
                "L3_store": None if l3 is None else {"backend": l3.backend, "scope": l3.flush_scope(),
                                                     "objects_removed": store, "error": error}}

    async def gauges(self) -> dict:
        load = self.core.load()
        return {"strata_worker_running": load.running, "strata_kv_pages_free": load.free_pages}

    async def server_info(self) -> dict:
        c = self.core.engine.cfg
        return {"model_path": self.model_path, "served_model_name": self.model_name,
                "context_length": self.max_context, "page_size": c.page_size,
                "max_total_num_tokens": c.page_size * c.num_pages, "disable_radix_cache": not c.enable_prefix_cache,
                "enable_hierarchical_cache": c.hicache is not None}

    def close(self) -> None:
        self.core.close()
