"""The L3 service (actors/storage.py) with real components: the file evictor and the router's view of L3,
a real mooncake_master that dies mid-serving and is restarted, and the Ray actor shell."""
from __future__ import annotations

import os
import sys
import time
import uuid

import pytest
import torch

from actors.routing import L3_WORKER, PrefixIndex
from actors.storage import StorageConfig, StorageService
from engine import Engine, SamplingParams
from engine.request import Status
from engine.worker_load import WorkerLoad
from storage.config import HiCacheConfig
from storage.hashing import page_keys
from storage.l3 import L3Config, l3_key, make_store
from storage.l3.index import L3NameIndex
from storage.radix.node import KVEvent

from .conftest import MOONCAKE_TEST, random_pages
from tests import numerics
from storage.geometry import KVGeometry

SP = SamplingParams(max_new_tokens=8, ignore_eos=True)
PAGE = 4096 * 2 + 64      # random_pages' bf16 pages plus the header


def _keys(n: int, seed: int = 0) -> list[bytes]:
    return page_keys([(seed * 7 + i) % 256 for i in range(16 * n)], 16)


def test_storage_config_validation():
    with pytest.raises(ValueError, match="storage.high_water"):
        StorageConfig(high_water=1.5)
    with pytest.raises(ValueError, match="low_water"):
        StorageConfig(high_water=0.5, low_water=0.6)
    with pytest.raises(ValueError, match="evict_interval_s"):
        StorageConfig(evict_interval_s=0)
    with pytest.raises(ValueError, match="l3 must be an L3Config"):
        StorageService({"backend": "file"})


def test_yaml_maps_storage_and_prefetch_settings():
    from cluster.config import from_text

    cfg = from_text("storage: {high_water: 0.5, low_water: 0.2}\n"
                    "engine: {enable_prefix_cache: true, hicache: {l3: {prefetch_policy: best_effort}}}")
    assert cfg.storage.high_water == 0.5 and cfg.engine.hicache.l3.prefetch_policy == "best_effort"
    with pytest.raises(ValueError, match="storage.low_water"):
        from_text("storage: {high_water: 0.5, low_water: 0.7}")
    with pytest.raises(ValueError, match="prefetch_policy"):
        from_text("engine: {enable_prefix_cache: true, hicache: {l3: {prefetch_policy: soon}}}")


def test_file_evictor_keeps_cap_and_router_forgets_evicted_pages(tmp_path):
    cap = 40 * PAGE
    svc = StorageService(L3Config(backend="file", path=str(tmp_path / "l3"), capacity_bytes=cap),
                         StorageConfig(high_water=0.75, low_water=0.5))
    wcfg = svc.worker_config()
    assert not wcfg.evict and wcfg.path == str(tmp_path / "l3")
    worker = make_store(wcfg)
    model = f"m-{uuid.uuid4().hex[:6]}"
    names, index = L3NameIndex(model), PrefixIndex()
    keys = _keys(60)
    written = []
    for lo in range(0, 60, 10):     # a worker writes, reports; the storage service evicts, reports
        batch = keys[lo:lo + 10]
        ok = worker.batch_set([l3_key(model, "full", k) for k in batch], random_pages(10, seed=lo))
        stored = [k for k, o in zip(batch, ok) if o]
        written += stored
        ev = [KVEvent("stored", "L3", "full", tuple(stored))]
        index.apply(L3_WORKER, ev)
        names.stored(ev)
        svc.store.refresh()
        assert svc.store.used_bytes() <= cap                      # a worker never writes past the cap
        index.apply(L3_WORKER, names.removed(svc.evict()))
        assert svc.store.used_bytes() <= 0.75 * cap
    assert len(written) > 40 and svc.evicted > 0
    on_disk = {k for k in written if worker.batch_exists([l3_key(model, "full", k)]) == 1}
    counted = {k for k in written if index.overlap([int.from_bytes(k[:8], "big")], "w0", 0).by_tier["L3"] == 1}
    assert counted == on_disk and 0 < len(on_disk) < len(written)
    st = svc.status()
    assert st["used_bytes"] <= cap and st["evicted_pages"] == svc.evicted and st["backend"] == "file"
    worker.close()
    svc.close()


def _wait(fn, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if fn():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.numerics
def test_killed_master_means_misses_until_the_service_restarts_it(mooncake_master, tmp_path):
    """Engine A writes, engine B reads through a master the storage service owns. Killing the master
    turns L3 into misses (bounded by the client's op timeout, tokens still right); the service restarts
    it and L3 serves again."""
    from storage.ports import free_port

    l3 = L3Config(backend="mooncake", capacity_bytes=64 << 20, prefetch_policy="wait_complete", prefetch_min_tokens=0,
                  mooncake=dict(master_addr=f"127.0.0.1:{free_port()}", **MOONCAKE_TEST))
    svc = StorageService(l3, log_dir=str(tmp_path))
    wcfg = svc.worker_config()
    ref = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256)

    def engine():
        return Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256, enable_prefix_cache=True,
                                      poison_kv=True, hicache=HiCacheConfig(host_pages=256, l3=wcfg))

    g = torch.Generator().manual_seed(9)

    def turn(a, b, during=None):
        p = torch.randint(0, 256, (200,), generator=g).tolist()
        first = a.generate([p], SP)[0]
        a.cache.poll(block=True)
        t2 = p + first.token_ids + [3] * 20
        rid = b.add_request(t2, SP)
        b.step()                                   # B's L3 lookup is under way
        if during is not None:
            during()
        while b.requests[rid].status is not Status.FINISHED:
            b.step()
        got = b.pop_finished(rid)
        numerics.assert_same_output(got, ref.generate([t2], numerics.with_logits(SP))[0], ref.model_config)
        return got.cached_tokens_by_tier["L3"]

    a, b = engine(), engine()
    try:
        assert turn(a, b) == 192
        # The master's own view (its Prometheus metrics) and an audit of what the router would count.
        names = L3NameIndex(a.model_id())
        names.stored(a.cache.tree.take_events())
        st = svc.status()
        assert st["used_bytes"] > 0 and st["master"]["keys"] >= len(names) > 0
        assert svc.audit(names.entries()) == [] and not svc.master_evicted()
        key, name = names.entries()[3]
        assert svc.client.raw.remove(key, True) == 0            # gone behind the router's back
        assert svc.audit(names.entries()) == [name]
        # Pages live in the service's segment (preferred), not the writer's: they outlive engine A.
        p = torch.randint(0, 256, (200,), generator=g).tolist()
        w = engine()
        t2 = p + w.generate([p], SP)[0].token_ids + [5] * 20
        w.cache.poll(block=True)
        w.close()
        got = b.generate([t2], SP)[0]
        assert got.cached_tokens_by_tier["L3"] == 192
        numerics.assert_same_output(got, ref.generate([t2], numerics.with_logits(SP))[0], ref.model_config)
        got = turn(a, b, during=svc.master.kill)  # killed while B is serving
        assert got in (0, 192)                     # (B's lookup may have beaten the kill)
        assert turn(a, b) == 0                     # misses, same tokens, no hang
        assert turn(a, b) == 0
        assert svc.supervise() and not svc.supervise()
        st = svc.status()
        assert st["master"]["alive"] and st["master"]["restarts"] == 1
        assert _wait(lambda: turn(a, b) == 192, 60.0)   # the clients remount on the new master
        a.check_integrity()
        b.check_integrity()
    finally:
        for e in (a, b):
            e.close()
        svc.close()


def test_storage_actor_shell_with_router(tmp_path):
    """The Ray shell: the evictor thread publishes its evictions on the L3 stream, which the real router
    actor follows (told by the storage actor at start, and by a worker's report), so it stops counting."""
    import ray

    from cluster.launch import start_local_ray  # also sets the Ray environment

    from actors.router import PrefixRouterActor
    from actors.routing import RouterConfig
    from actors.storage import StorageActor
    from storage.kv_events import KVEventsConfig

    start_local_ray(num_cpus=2, namespace=f"l3-{uuid.uuid4().hex[:6]}")
    try:
        router = PrefixRouterActor.options(name="router").remote(RouterConfig(), KVGeometry(16), storage="storage")
        cap = 30 * PAGE
        model = "shell-model"
        actor = StorageActor.options(name="storage").remote(
            L3Config(backend="file", path=str(tmp_path / "l3"), capacity_bytes=cap),
            StorageConfig(evict_interval_s=0.2, high_water=0.6, low_water=0.3), "router",
            ray.get_runtime_context().namespace, kv_events=KVEventsConfig(), l3_model=model, geometry=(16, 0))
        wcfg = ray.get(actor.worker_config.remote(), timeout=120)
        store = make_store(wcfg)
        keys = _keys(20, seed=1)
        blocks = [int.from_bytes(k[:8], "big") for k in keys]
        assert store.batch_set([l3_key(model, "full", k) for k in keys], random_pages(20)) == [True] * 20
        # What a worker does with the L3 writes its tree records: forward them, then report the position.
        pos = ray.get(actor.l3_stored.remote([KVEvent("stored", "L3", "full", tuple(keys))]), timeout=60)
        assert pos.seq >= 0
        reply = ray.get(router.report.remote("w0", "colocated", WorkerLoad(), True, None, pos))
        assert not reply.ignored

        def l3_pages() -> int:
            ray.get(router.sync.remote())
            return ray.get(router.route.remote(blocks, 16 * 21)).by_tier["L3"]

        def counted() -> int:   # L3 pages the router's index holds
            ray.get(router.sync.remote())
            return len(ray.get(router.indexed_blocks.remote("L3")).get("L3", {}).get("full", []))

        def on_disk() -> int:
            return sum(store.batch_exists([l3_key(model, "full", k)]) for k in keys)

        # 20 pages > 60% of the cap: the evictor thread trims to 30% (it may have begun already) and the
        # router follows the evictions on the L3 stream.
        assert _wait(lambda: ray.get(actor.status.remote(), timeout=60)["evicted_pages"] > 0, 60.0)
        assert _wait(lambda: counted() == on_disk(), 10.0)
        left = on_disk()
        present = store.batch_exists([l3_key(model, "full", k) for k in keys])   # the leading run only
        assert 0 < left < 20 and l3_pages() == present
        assert len(ray.get(actor.l3_entries.remote())) == left
        st = ray.get(actor.status.remote(), timeout=60)
        assert st["used_bytes"] <= 0.3 * cap and st["evicted_pages"] == 20 - left
        assert ray.get(actor.run_once.remote(), timeout=60)["evicted"] == 0
        # A consumer that lost the L3 history asks for a snapshot: it says again what the store holds.
        snap = ray.get(actor.kv_snapshot.remote(), timeout=60)
        assert snap.seq > pos.seq and counted() == left and l3_pages() == present
        # The storage actor evicts, audits and reports without torch (~2 s and ~180 MiB a (re)start); nor
        # does the router.
        for a in (actor, router):
            assert ray.get(a.__ray_call__.remote(
                lambda self: sorted(m for m in sys.modules if m.split(".")[0] == "torch")), timeout=60) == []
        ray.get(actor.shutdown.remote(), timeout=60)
        store.close()
    finally:
        ray.shutdown()
