"""The fault catalog: each fault is one small function registered with ``@fault``, that injects the
fault into a running cluster and returns how to tell it has healed. ``run_under_load`` does the rest for
every fault alike: the multi-turn load runs, the fault strikes, in-flight clients must get an answer or a
clean error (never a hang), the service must come back within a generous bound, and afterwards no
request gets a wrong token.

A fault whose feature is not in this build names the module it needs (``needs``); its test skips with
"needs <module>" until that lands, and runs as is once it has."""
from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx
import ray

from tests.reliability.judge import brief, verify
from tests.reliability.workload import ERROR, HUNG, Load, LoadConfig, Recorder
from tests import numerics
from storage.geometry import KVGeometry
from storage.transfer import TransferConfig


@dataclass
class Ctx:
    handles: dict
    url: str
    reference: object          # an offline Engine on the same model (the oracle for tokens)
    l3_dir: str = ""
    load: Load | None = None   # the running load (set by run_under_load): a fault may pause it


@dataclass
class Healed:
    """What an injected fault returns: ``check()`` is true once the hurt component is back."""
    target: str
    check: Callable[[], bool] = lambda: True
    # The clean errors an in-flight client may see for this fault (besides a 503 or an SSE error event).
    connection_errors_ok: bool = False
    # A fault that, by design, costs nothing to clients (L3 corruption: a miss, recomputed).
    no_errors: bool = False
    extra: dict = field(default_factory=dict)
    # Run once the component is back: asserts what must work again (e.g. L3 hits), returns figures.
    after: Callable[[], dict] | None = None


@dataclass
class Fault:
    name: str
    inject: Callable[[Ctx], Healed]
    expect: str
    needs: str | None = None

    def available(self) -> bool:
        return self.needs is None or importlib.util.find_spec(self.needs) is not None


FAULTS: dict[str, Fault] = {}


def fault(name: str, expect: str, needs: str | None = None):
    def deco(fn: Callable[[Ctx], Healed]) -> Callable[[Ctx], Healed]:
        FAULTS[name] = Fault(name, fn, expect, needs)
        return fn
    return deco


def _pid(handle) -> int:
    return ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=10)


def _restarted(handle, old_pid: int) -> Callable[[], bool]:
    """True once the actor answers from a new process (a ping right after ray.kill may still reach the
    old one)."""
    def check() -> bool:
        try:
            return _pid(handle) != old_pid
        except Exception:
            return False
    return check


def _kill_worker(ctx: Ctx, wid: str) -> Healed:
    w = ctx.handles["workers"][wid]
    old = _pid(w)
    ray.kill(w, no_restart=False)
    return Healed(wid, _restarted(w, old))


@fault("kill_prefill", "in-flight requests on it get 503 / an SSE error (non-streamed ones are retried on "
                       "the other prefill worker); the actor restarts and rejoins routing")
def kill_prefill(ctx: Ctx) -> Healed:
    return _kill_worker(ctx, "prefill-0")


@fault("kill_decode", "in-flight streams get an SSE error event, non-streamed requests are retried once "
                      "the decode worker is back; the actor restarts")
def kill_decode(ctx: Ctx) -> Healed:
    return _kill_worker(ctx, "decode-0")


@fault("kill_router", "the router restarts; calls queued meanwhile are retried by Ray and a request that "
                      "finds it knowing no worker yet waits for the workers' next reports (they re-report "
                      "their caches as fresh); a route call lost with the old process gets 503")
def kill_router(ctx: Ctx) -> Healed:
    router = ctx.handles["router"]
    old = _pid(router)
    ray.kill(router, no_restart=False)
    back = _restarted(router, old)

    def check() -> bool:
        if not back():
            return False
        st = ray.get(router.status.remote(), timeout=5)
        return set(st["workers"]) >= set(ctx.handles["workers"])
    def after() -> dict:   # a restarted router follows the L3 store's stream again (the workers name it)
        if _l3_backend(ctx) is None:
            return {}
        deadline = time.monotonic() + 30
        while "L3" not in (st := ray.get(router.status.remote(), timeout=30))["kv_events"]:
            assert time.monotonic() < deadline, "the restarted router never followed the L3 stream again"
            time.sleep(0.2)
        return {"router_l3_stream_next_seq": st["kv_events_feed"]["next_seq"]["L3"]}
    return Healed("router", check, after=after)


def ingress_replicas() -> list:
    """The live Serve replica actors of the ingress deployment."""
    out = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        if "SERVE_REPLICA" in a["name"] and "ingress" in a["name"]:
            out.append((a["name"], a["namespace"]))
    return out


@fault("kill_ingress", "the HTTP connections of in-flight requests close (or get HAProxy's JSON 502) at "
                       "once; Serve starts a new replica and serves again")
def kill_ingress(ctx: Ctx) -> Healed:
    names = ingress_replicas()
    assert names, "no ingress replica found"
    name, ns = names[0]
    replica = ray.get_actor(name, namespace=ns)
    old = _pid(replica)
    ray.kill(replica, no_restart=False)

    def check() -> bool:  # a new replica, or the same one restarted in a new process
        live = ingress_replicas()
        if any(n != name for n, _ in live):
            return True
        return bool(live) and _restarted(replica, old)()
    return Healed("ingress", check, connection_errors_ok=True)


@fault("corrupt_l3", "every L3 page has bytes flipped (files on disk, or objects in mooncake's segment): "
                     "reads fail their checksum, count as misses, and the prefix is recomputed; clients see "
                     "nothing but identical tokens")
def corrupt_l3(ctx: Ctx) -> Healed:
    from engine import SamplingParams
    # A long prompt whose pages are in L3 for sure (written through, then read back by its next turn).
    hist = [(i * 17 + 5) % 256 for i in range(600)]
    body = {"input_ids": hist, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    httpx.post(f"{ctx.url}/generate", json=body, timeout=120).raise_for_status()
    mooncake = _l3_backend(ctx) == "mooncake"
    keys = _l3_keys(ctx, hist) if mooncake else []
    stored = (lambda: _mooncake_present(keys)) if mooncake else (lambda: _count_files(ctx.l3_dir))
    deadline = time.monotonic() + 30
    while stored() < len(hist) // 16 and time.monotonic() < deadline:
        time.sleep(0.2)
    with ctx.load.paused():   # flush needs idle workers: afterwards only L3 holds the prefix
        # Mooncake: this prompt's pages and every page the router counts (the soak's conversations).
        n = corrupt_mooncake(sorted(set(keys) | set(_router_l3_keys(ctx)))) if mooncake else corrupt_files(ctx.l3_dir)
        _flush_l1_l2(ctx)   # not /flush_cache: it would delete the corrupted pages too
    turn2 = hist + [7] * 40
    r = httpx.post(f"{ctx.url}/generate", json={**body, "input_ids": turn2}, timeout=120).json()
    want = ctx.reference.generate([turn2], SamplingParams(max_new_tokens=4, temperature=0.0, return_logits=True))[0]
    numerics.assert_same_output(r["output_ids"], want, ctx.reference.model_config, "after reading corrupt L3 pages")
    l3_hit = r["meta_info"]["cached_tokens_by_tier"].get("L3", 0)
    assert l3_hit == 0, f"a corrupt L3 page was used ({l3_hit} tokens)"
    assert n >= len(hist) // 16, f"only {n} L3 pages were there to corrupt"
    return Healed("l3", no_errors=True, extra={"corrupted_pages": n, "l3_hit_tokens_after": l3_hit})


def _l3_backend(ctx: Ctx) -> str | None:
    hc = ctx.handles["cfg"].engine.hicache
    return hc.l3.backend if hc is not None and hc.l3 is not None else None


def _router_l3_keys(ctx: Ctx) -> list[str]:
    """The store keys of every L3 page the router counts: what the L3 store's stream says it holds."""
    return [k for k, _ in ray.get(ray.get_actor("strata-storage").l3_entries.remote(), timeout=30)]


def _l3_keys(ctx: Ctx, tokens: list[int]) -> list[str]:
    """The L3 store keys of a prompt's whole pages, both components (computed as the workers do)."""
    from pathlib import Path

    from actors.routing import RouterConfig, prompt_keys
    from engine.engine import model_id
    from storage.l3.base import l3_key
    cfg = ctx.handles["cfg"]
    mid = model_id(Path(ctx.handles["model_path"]), ctx.handles["model_config"], cfg.engine)
    pks = prompt_keys(tokens, KVGeometry(cfg.engine.page_size), RouterConfig())
    return [l3_key(mid, c, k) for c in ("full", "swa") for k in pks]


def _mooncake_present(keys: list[str]) -> int:
    def count(actor, keys: list[str]) -> int:
        return sum(actor.service.client.present(keys) or [])
    return ray.get(ray.get_actor("strata-storage").__ray_call__.remote(count, keys), timeout=30)


def corrupt_mooncake(keys: list[str]) -> int:
    """Flip a byte in the middle of each of these objects, inside the storage actor (its client's segment
    holds them): the object is read, damaged, removed and put back under its key. Returns how many."""
    def damage(actor, keys: list[str]) -> int:
        raw, n = actor.service.client.raw, 0
        for k in keys:
            blob = raw.get(k)
            if not blob:
                continue   # evicted meanwhile
            blob = bytearray(blob)
            blob[len(blob) // 2] ^= 0x40
            if raw.remove(k, True) == 0 and raw.put(k, bytes(blob)) == 0:
                n += 1
        return n
    return ray.get(ray.get_actor("strata-storage").__ray_call__.remote(damage, keys), timeout=120)


def _count_files(root: str) -> int:
    return sum(len(f) for _, _, f in os.walk(os.path.join(root, "v1")))


def _flush_l1_l2(ctx, timeout: float = 60.0) -> None:
    """Empty every worker's L1 and L2 (and its tree) but keep the shared L3 store, which /flush_cache
    clears too: the next request finds its prefix only in L3. The same two phases as /flush_cache
    (actors/flush.py): every worker holds admissions while idle, then each flushes."""
    import ray
    workers = list(ctx.handles["workers"].values())
    deadline = time.monotonic() + timeout
    while True:
        holds = ray.get([w.flush_hold.remote(30.0) for w in workers], timeout=60)
        if all(h is None for h in holds):
            break
        ray.get([w.flush_release.remote() for w in workers], timeout=60)
        assert time.monotonic() < deadline, f"workers stayed busy: {holds}"
        time.sleep(0.2)
    try:
        res = ray.get([w.flush_cache.remote(False) for w in workers], timeout=60)
        assert all(r["flushed"] for r in res), res
    finally:
        ray.get([w.flush_release.remote() for w in workers], timeout=60)


def corrupt_files(root: str) -> int:
    """Flip bytes in every published page file under an L3 file-store directory (header and data)."""
    n = 0
    for d, _, files in os.walk(os.path.join(root, "v1")):
        for f in files:
            p = os.path.join(d, f)
            try:
                with open(p, "r+b") as fh:
                    size = os.fstat(fh.fileno()).st_size
                    for off in {size // 2, size - 1}:
                        if off >= 0:
                            fh.seek(off)
                            b = fh.read(1)
                            fh.seek(off)
                            fh.write(bytes([b[0] ^ 0xFF]) if b else b"\x00")
                n += 1
            except OSError:  # evicted under us: fine
                pass
    return n


# ---- faults of features still landing (written against the interface they are expected to have) ----

@fault("kill_storage", "L3 turns into misses while the StorageActor restarts; serving continues with "
                       "identical tokens; L3 hits resume", needs="actors.storage")
def kill_storage(ctx: Ctx) -> Healed:
    storage = _actor_or_skip("strata-storage")
    old = _pid(storage)
    ray.kill(storage, no_restart=False)
    def after() -> dict:
        out = {}
        if _l3_backend(ctx) == "mooncake":   # the new actor has a new segment: every worker must follow it
            t0, seg = time.monotonic(), ray.get(storage.worker_segment.remote(), timeout=30)
            while (prefs := _preferred_segments(ctx)) != dict.fromkeys(prefs, seg):
                assert time.monotonic() - t0 < 30, f"workers still place L3 pages in {prefs}, not {seg}"
                time.sleep(0.5)
            out["workers_follow_segment_s"] = round(time.monotonic() - t0, 2)
        return {**out, **l3_serves(ctx, "kill_storage")}
    return Healed("storage", _restarted(storage, old), after=after)


def _preferred_segments(ctx: Ctx) -> dict[str, str]:
    """Each worker's Mooncake L3 client's preferred segment."""
    def pref(self) -> str:
        return self.core.engine.cache.l3.store.preferred_segment
    ws = ctx.handles["workers"]
    return dict(zip(ws, ray.get([w.__ray_call__.remote(pref) for w in ws.values()], timeout=30)))


def l3_serves(ctx: Ctx, tag: str, timeout: float = 60.0) -> dict:
    """L3 works again: a fresh prompt's pages reach L3 (written through), and once L1 and L2 are flushed
    (the L3 store kept) its next turn is served partly from L3 with the right tokens. Returns the L3
    tokens and the time."""
    import random

    from engine import SamplingParams
    rng = random.Random(tag)
    turn = [rng.randrange(256) for _ in range(320)]
    sp = {"max_new_tokens": 4, "temperature": 0}
    t0 = time.monotonic()
    httpx.post(f"{ctx.url}/generate", json={"input_ids": turn, "sampling_params": sp}, timeout=120).raise_for_status()
    while True:
        time.sleep(1.0)   # the write-through is asynchronous
        turn = turn + [9] * 24   # the next turn: its prefix is the last one, whose pages L3 should have
        want = ctx.reference.generate([turn], SamplingParams(max_new_tokens=4, temperature=0.0, return_logits=True))[0]
        with ctx.load.paused():
            _flush_l1_l2(ctx)
            r = httpx.post(f"{ctx.url}/generate", json={"input_ids": turn, "sampling_params": sp}, timeout=120)
        r.raise_for_status()
        numerics.assert_same_output(r.json()["output_ids"], want, ctx.reference.model_config, f"{tag}: from L3")
        l3 = r.json()["meta_info"]["cached_tokens_by_tier"].get("L3", 0)
        if l3 > 0:
            return {"l3_hit_tokens_after": l3, "l3_serves_again_s": round(time.monotonic() - t0, 2)}
        assert time.monotonic() - t0 < timeout, f"{tag}: L3 served no hit within {timeout:.0f}s of recovery"


def _actor_or_skip(name: str):
    """A named actor of a feature that is in the build but may be off in this cluster's YAML."""
    try:
        return ray.get_actor(name)
    except ValueError:
        import pytest
        pytest.skip(f"the cluster runs no {name} actor (off in its configuration)")


@fault("stop_mooncake_master", "L3 reads and writes fail and count as misses; the StorageActor restarts "
                               "mooncake_master; L3 hits resume", needs="actors.storage")
def stop_mooncake_master(ctx: Ctx) -> Healed:
    import signal
    storage = _actor_or_skip("strata-storage")
    pid = (ray.get(storage.status.remote(), timeout=10).get("master") or {}).get("pid")
    if pid is None:
        import pytest
        pytest.skip("needs a cluster whose L3 is mooncake (this one's has no mooncake_master)")
    os.kill(pid, signal.SIGKILL)
    return Healed("mooncake_master", lambda: (ray.get(storage.status.remote(), timeout=5).get("master") or {})
                  .get("pid") not in (None, pid), after=lambda: l3_serves(ctx, "stop_mooncake_master"))


STALL_TIMEOUT_S = 5.0


@fault("slow_transfer", "prefill-0's prefill->decode sends stall past transfer_timeout: those requests fail "
                        "cleanly (503 / SSE error), the decode side's leased pages are freed; prefill-1 keeps "
                        "serving; the stall is lifted", needs="storage.transfer")
def slow_transfer(ctx: Ctx) -> Healed:
    pre = ctx.handles["workers"]["prefill-0"]

    def options(**changes) -> TransferConfig:
        return ray.get(pre.set_transfer_options.remote(**changes), timeout=30)

    # For the fault, prefill-0's send timeout is cut to STALL_TIMEOUT_S and every send stalls past it:
    # the same failure as a 20 s timeout (each of its requests fails), healed in seconds, not a minute.
    normal = options().transfer_timeout
    timeout = min(normal, STALL_TIMEOUT_S)
    delay = timeout + 2.0
    options(transfer_timeout=timeout, debug_send_delay=delay)
    t0 = time.monotonic()
    lifted: list[float] = []

    def check() -> bool:  # lifted once a stalled send must have hit its timeout; healed once the sends
        now = time.monotonic()   # stalled before the lift have all failed (they sleep ``delay``)
        if not lifted:
            if now - t0 < timeout + 3.0:
                return False
            options(debug_send_delay=0.0, transfer_timeout=normal)
            lifted.append(now)
        return now - lifted[0] > delay + 1.0
    return Healed("transfer", check, extra={"transfer_timeout_s": timeout})


@fault("eplb_rebalance", "a rebalance under load swaps expert placement between steps: no request fails, "
                         "no token changes", needs="actors.eplb_actor")
def eplb_rebalance(ctx: Ctx) -> Healed:
    eplb = _actor_or_skip("strata-eplb")
    ray.get(eplb.trigger.remote(), timeout=120)
    return Healed("eplb", no_errors=True)


# ---- the common harness ------------------------------------------------------------------------------

def probe(url: str, reference, ids: list[int], n: int = 6, timeout: float = 60.0) -> bool:
    """One fresh greedy request answered with the right tokens."""
    from engine import SamplingParams
    try:
        r = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": n, "temperature": 0}}, timeout=timeout)
    except httpx.HTTPError:
        return False
    if r.status_code != 200:
        return False
    want = reference.generate([ids], SamplingParams(max_new_tokens=n, temperature=0.0, return_logits=True))[0]
    numerics.assert_same_output(r.json()["output_ids"], want, reference.model_config, "after a fault")
    return True


def run_under_load(ctx: Ctx, name: str, load: Load | None = None, warmup_s: float = 6.0,
                   after_s: float = 4.0, recovery_bound_s: float = 120.0) -> dict:
    """Inject fault ``name`` while ``load`` runs (a running ``Load``; else one is started for the call)
    and return the measurements; raises AssertionError when an expected outcome does not hold. The
    requests judged are those in flight at the injection or started after it."""
    if load is None:
        with Load(ctx.url, LoadConfig(clients=3, abort_prob=0.1), seed=sum(map(ord, name))) as ld:
            time.sleep(warmup_s)
            return run_under_load(ctx, name, ld, after_s=after_s, recovery_bound_s=recovery_bound_s)
    f = FAULTS[name]
    ctx.load = load
    t0 = time.monotonic()
    healed = f.inject(ctx)
    # Recovered: the component is back and a fresh request gets the right answer.
    ids = [(t * 31 + len(name)) % 256 for t in range(40)]
    served_at = back_at = None
    while time.monotonic() - t0 < recovery_bound_s:
        now = time.monotonic()
        if back_at is None and healed.check():
            back_at = time.monotonic()  # a check may block until the component answers
        if served_at is None and probe(ctx.url, ctx.reference, ids):
            served_at = time.monotonic()
        if served_at is not None and back_at is not None:
            break
        time.sleep(0.25)
    assert served_at is not None, f"{name}: no request served within {recovery_bound_s:.0f}s"
    assert back_at is not None, f"{name}: {healed.target} not back within {recovery_bound_s:.0f}s"
    healed_at = max(served_at, back_at)
    after = healed.after() if healed.after is not None else {}
    time.sleep(after_s)
    t_end = time.monotonic()
    outs = [o for o in list(load.rec.outcomes) if t0 <= o.ended <= t_end]
    hung = [o for o in outs if o.kind == HUNG]
    assert not hung, f"{name}: {len(hung)} requests hung: {[o.detail for o in hung[:3]]}"
    errors = [o for o in outs if o.kind == ERROR]
    for o in errors:
        sse_error = o.status == 200 and not o.detail.startswith("connection")
        clean = o.status == 503 or sse_error or \
            (healed.connection_errors_ok and (o.detail.startswith("connection") or o.status >= 500))
        assert clean, f"{name}: unclean failure status={o.status} {o.detail!r}"
        # An HTTP error, from the app or from HAProxy for a replica that died, says what happened in JSON
        # (the API's error shape), never a bare text page.
        answered = o.status != 200 and not o.detail.startswith("connection")
        assert not answered or o.detail.startswith("{"), f"{name}: an error not in JSON: {o.status} {o.detail!r}"
    if healed.no_errors:
        assert not errors, f"{name}: {len(errors)} requests failed: {[o.detail for o in errors[:3]]}"
    # Once healed (plus a grace for requests routed before), everything succeeds again.
    late = [o for o in outs if o.started > healed_at + 2.0 and o.kind == ERROR]
    assert not late, f"{name}: {len(late)} requests failed after recovery: {[o.detail for o in late[:3]]}"
    sub = Recorder(outs)
    v = verify(sub, ctx.reference)
    assert not v["wrong"], f"{name}: {len(v['wrong'])} requests got wrong tokens: {brief(v['wrong'])[:3]}"
    return {"fault": name, "requests": len(outs), "counts": sub.counts(),
            "in_flight_errors": len(errors), "error_details": sorted({f"{o.status} {o.detail[:80]}" for o in errors}),
            "service_gap_s": round(served_at - t0, 2), "component_back_s": round(back_at - t0, 2),
            "checked_tokens": v["checked"], **healed.extra, **after}
