"""Ray shells over one worker's AsyncEngine: prefill, decode, or colocated (both).

Each worker pushes its KV events and load to the router every ``report_interval`` seconds; the first
report after a (re)start says ``fresh`` so the router forgets what a previous incarnation held.
"""
from __future__ import annotations

import logging
import os
import threading

import ray

from engine import Engine, EngineConfig, SamplingParams
from engine.async_engine import AsyncEngine, StreamItem

log = logging.getLogger("strata.worker")


@ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=1000)
class WorkerActor:
    def __init__(self, worker_id: str, role: str, engine_cfg: EngineConfig, router=None,
                 report_interval: float = 0.05) -> None:
        if role not in ("prefill", "decode", "colocated"):
            raise ValueError(f"role must be prefill, decode or colocated, got {role!r}")
        self.worker_id, self.role = worker_id, role
        self.core = AsyncEngine(Engine(engine_cfg), worker_id)
        self.router = router
        self.report_interval = report_interval
        # A thread, started here, so a restarted actor reports again without anyone calling it.
        self._stop = threading.Event()
        if router is not None:
            threading.Thread(target=self._report_loop, name="strata-report", daemon=True).start()

    async def start(self) -> dict:
        mc = self.core.engine.model_config
        return {"worker_id": self.worker_id, "role": self.role, "vocab_size": mc.vocab_size,
                "max_context": mc.max_position_embeddings, "model_path": str(self.core.engine.model_path)}

    def _report_loop(self) -> None:
        fresh, pending = True, []
        while not self._stop.wait(self.report_interval):
            try:
                pending += self.core.call_blocking(
                    lambda e: e.cache.tree.take_events() if e.cache is not None else [])
                ray.get(self.router.report.remote(self.worker_id, self.role, pending, self.core.load(), fresh),
                        timeout=10)
                fresh, pending = False, []
            except Exception as e:  # the router may be restarting: resend everything as fresh
                log.warning("report to router failed: %r", e)
                fresh = True

    # ---- serving ---------------------------------------------------------------------------------
    @ray.method(num_returns=2)
    async def prefill(self, ids: list[int], params: SamplingParams):
        """Prefill and sample the first token; returns (StreamItem without payload, KVPayload)."""
        last = None
        async for item in self.core.generate(ids, params, prefill_only=True):
            last = item
        payload, last.kv_payload = last.kv_payload, None
        return last, payload

    async def generate(self, ids: list[int], params: SamplingParams):
        async for item in self.core.generate(ids, params):
            yield item

    async def decode(self, ids: list[int], payload, params: SamplingParams):
        async for item in self.core.decode(ids, payload, params):
            yield item

    # ---- operations ------------------------------------------------------------------------------
    async def load(self) -> dict:
        return self.core.load()

    async def stats(self) -> dict:
        return await self.core.stats()

    async def flush_cache(self) -> bool:
        return await self.core.flush_cache()

    async def ping(self) -> str:
        return self.worker_id

    async def check_integrity(self) -> bool:
        """Check the engine's invariants (pools, radix tree, tiers) on the engine thread; raises
        AssertionError naming the first broken one."""
        await self.core.call(lambda e: e.check_integrity())
        return True

    async def process_info(self) -> dict:
        """This worker process's id and memory (anonymous RSS: what a leak grows; shared object-store
        pages are left out), for soak tests that compare it over time."""
        info = {"worker_id": self.worker_id, "pid": os.getpid()}
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "RssAnon:")):
                    key, kb = line.split()[:2]
                    info["rss_anon_bytes" if key == "RssAnon:" else "rss_bytes"] = int(kb) * 1024
        return info
