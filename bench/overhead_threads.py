"""``python -m bench.overhead --threads``: where a server's short requests spend CPU, thread by thread, and how
its workers batch them, against the same requests in one process.

The server (``--configs``: colocated by default) runs the bench's short load (64 requests of 32 tokens, 8 new,
16 in flight, closed loop) a few times. Each thread of each of its processes (and of the load generator) has
its CPU (/proc/<pid>/task/<tid>/stat) per request, named by the process's kind and the thread's Python name
(asked of each named actor through ``__ray_call__``; a thread Python did not start keeps its OS name). Each
worker says its engine steps and decode rows per request (``stats()``). In this process the same engine
settings run the same requests as the engine row does (4 waves of 16, on the engine's own thread) and as the
server gets them (``AsyncEngine``, 16 in flight): the engine thread's CPU and its steps per request. Then the
cached TTFT and the 64-token request by turns over HTTP and on an engine built in the process of the worker
that makes their tokens (``in_worker_turns``: its core, its neighbours, the same pause before each request),
with that worker's engine thread's CPU per request either way.

What this showed (session 45, colocated, the worker unbound): the worker's engine thread is the bound,
6.3-8.4 ms of CPU per short request against 5.2-6.2 in one process either way, the same CPU per step; the
server's steps hold ~10 decode rows where one process's hold ~14-16 (each request is out of the worker for
its HTTP round trips), so 0.58-0.71 steps per request against 0.50-0.52. And (session 46, the worker bound)
by turns in the worker's process, colocated: the 64-token request 1.03-1.10x with the engine thread's CPU
the same (within 1%); the cached TTFT 3.3-4.3 ms over the engine's after the same 5 ms pause, of which
0.8-1.2 ms more CPU on the engine thread, the pause itself costing the engine ~1 ms there. 1P+1D: the TTFT
3.4-4.3 ms over the prefill worker's engine, the 64-token request 1.12-1.24x the decode worker's. Merged into
bench/results/overhead.json as ``threads_<config>``."""
from __future__ import annotations

import asyncio
import collections
import os
import statistics
import threading
import time

from bench.common import merge_json, table
from bench.overhead import (CLK, ENGINE, LONG, LONG_NEW, SHORT, SHORT_NEW, _cmdline, descendants, joined, kind_of,
                            prompts)

STEP_KEYS = ("steps", "decode_tokens", "prefill_tokens")


def thread_cpu(pids: list[int]) -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, tid) -> (the thread's OS name, its CPU seconds so far) for every thread of ``pids``."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                st = open(f"/proc/{pid}/task/{tid}/stat").read()
            except OSError:
                continue
            comm = st[st.index("(") + 1:st.rindex(")")]
            f = st[st.rindex(")") + 2:].split()
            out[(pid, int(tid))] = (comm, (int(f[11]) + int(f[12])) / CLK)
    return out


def python_threads(_actor=None) -> tuple[int, dict[int, str]]:
    """In the process it runs in (an actor's, through ``__ray_call__``): its pid and its Python threads'
    names by OS thread id."""
    return os.getpid(), {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def rows_per_thread(before: dict, after: dict, kinds: dict[int, str], names: dict[int, str],
                    requests: int, top: int = 12) -> list[dict]:
    """The ``top`` threads by CPU between two ``thread_cpu`` samples, in ms per request; the rest summed by
    process kind."""
    spent = []
    for key, (comm, cpu) in after.items():
        d = cpu - before.get(key, (comm, cpu))[1]
        if d > 0:
            spent.append((d, key, comm))
    spent.sort(reverse=True)
    rows = [{"process": kinds.get(pid, "?"), "thread": names.get(tid, comm), "cpu_ms_per_req": 1000 * d / requests}
            for d, (pid, tid), comm in spent[:top]]
    rest = collections.Counter()
    for d, (pid, _), _ in spent[top:]:
        rest[kinds.get(pid, "?")] += d
    rows += [{"process": k, "thread": "(the others)", "cpu_ms_per_req": 1000 * v / requests}
             for k, v in rest.most_common()]
    return rows


def worker_engine_request(_actor=None, new: int = 1, n: int = 1, pause: float = 0.0) -> tuple[list[float], float]:
    """In a worker's process (through ``__ray_call__``, on one of the actor's threads, which share the
    worker's core binding): ``n`` times the bench's cached 512-token prompt with ``new`` tokens on an engine
    of the server's settings built there once, each after ``pause`` seconds asleep. Returns each request's
    seconds and this thread's CPU seconds for all of them."""
    from engine import Engine, SamplingParams
    long = prompts(1, LONG, 1)[0]
    eng = _WORKER_ENGINE.get("engine")
    if eng is None:
        eng = _WORKER_ENGINE["engine"] = Engine.from_pretrained("strata-tiny", **ENGINE)
        eng.generate(long, SamplingParams(max_new_tokens=1, ignore_eos=True))   # cached, as the server's is
    sp = SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=0.0)
    lat, c0 = [], time.thread_time()
    for _ in range(n):
        time.sleep(pause)
        t = time.perf_counter()
        eng.generate(long, sp)
        lat.append(time.perf_counter() - t)
    return lat, time.thread_time() - c0


def worker_engine_close(_actor=None) -> None:
    eng = _WORKER_ENGINE.pop("engine", None)
    if eng is not None:
        eng.close()


_WORKER_ENGINE: dict = {}   # the engine worker_engine_request builds in a worker's process
# The in-worker engine sleeps this long before each request, as a sequential client's worker idles between
# its requests (the HTTP way out and back in: ~4-5 ms here): a step after an idle gap costs more on this VM.
PAUSE_S = 0.005


def in_worker_turns(srv, ray, workers: dict, engine_threads: dict, rounds: int) -> dict:
    """The cached TTFT and the 64-token request over HTTP and on an engine in the process of the worker that
    makes the request's tokens (the same core binding, the same neighbours: the colocated worker; in P/D the
    prefill worker for one token, the decode worker for 64; with two of a role, the first, and the HTTP
    side's CPU summed over that role's engine threads), that engine back to back and after a pause
    (PAUSE_S) before each request, by turns, the order swapped every round: what the serving path adds with
    the machine's minute and the process's place on it taken out, and what the pause alone costs there.
    Also that worker's engine thread's CPU per HTTP request (/proc, 10 ms ticks summed over every round)
    against the engine's thread's CPU there. ``workers``: name -> actor handle; ``engine_threads``: name ->
    its engine thread's (pid, tid)."""
    out: dict = {}
    long = prompts(1, LONG, 1)[0]
    sides = {"http": None, "worker_engine": PAUSE_S, "worker_engine_b2b": 0.0}   # the engine's pause (s)
    for key, new, per, role in (("ttft_cached", 1, 20, "prefill"), ("long64", LONG_NEW, 3, "decode")):
        name = next((w for w in workers if role in w), next(iter(workers)))
        if name not in engine_threads:
            continue
        handle = workers[name]
        threads = [engine_threads[w] for w in workers if role in w and w in engine_threads] or [engine_threads[name]]
        pids = sorted({pid for pid, _ in threads})

        def http_cpu() -> float:
            now = thread_cpu(pids)
            return sum(now[t][1] for t in threads if t in now)
        lat: dict[str, list[float]] = {k: [] for k in sides}
        cpu = dict.fromkeys(sides, 0.0)
        try:
            ray.get(handle.__ray_call__.remote(worker_engine_request, new, 1), timeout=300)
            for r in range(rounds):
                for side in list(sides) if r % 2 == 0 else list(sides)[::-1]:
                    if side == "http":
                        c0 = http_cpu()
                        a = srv.ask({"op": "requests", "prompts": [long] * per, "max_new": new, "concurrency": 1})
                        cpu[side] += http_cpu() - c0
                        lat[side] += a["latency"]
                    else:
                        ls, c = ray.get(handle.__ray_call__.remote(worker_engine_request, new, per, sides[side]),
                                        timeout=300)
                        lat[side] += ls
                        cpu[side] += c
        finally:
            ray.get(handle.__ray_call__.remote(worker_engine_close), timeout=60)
        p50 = {k: statistics.median(v) for k, v in lat.items()}
        out[key] = {"worker": name, "http_p50": p50["http"], "worker_engine_p50": p50["worker_engine"],
                    "worker_engine_b2b_p50": p50["worker_engine_b2b"],
                    "ratio_p50": p50["http"] / p50["worker_engine"], "requests": rounds * per,
                    "engine_thread_cpu_ms": {k: 1000 * v / (rounds * per) for k, v in cpu.items()}}
    return out


def server_rows(name: str, runs: int, rounds: int = 8) -> dict:
    with joined(name) as (srv, ray):
        names: dict[int, str] = {}
        workers = {}
        engine_threads: dict[str, tuple[int, int]] = {}   # worker -> its engine thread (pid, tid)
        for a in ray.util.list_named_actors(all_namespaces=True):
            handle = ray.get_actor(a["name"], namespace=a["namespace"])
            try:
                pid, threads = ray.get(handle.__ray_call__.remote(python_threads), timeout=30)
            except Exception:  # noqa: BLE001 - an actor that cannot answer keeps its threads' OS names
                continue
            names.update(threads)
            if a["namespace"] == "strata" and a["name"] not in ("strata-router", "strata-storage"):
                workers[a["name"]] = handle
                engine_threads.update({a["name"]: (pid, tid) for tid, t in threads.items() if t == a["name"]})
        pids = descendants(srv.proc.pid) + [srv.client.pid]
        kinds = {pid: kind_of(_cmdline(pid)) for pid in pids}
        kinds[srv.client.pid] = "client"
        n, rates, before_steps = 0, [], ray.get([w.stats.remote() for w in workers.values()])
        before = thread_cpu(pids)
        for i in range(runs):
            r = srv.ask({"op": "requests", "prompts": prompts(64, SHORT, 1000 + i), "max_new": SHORT_NEW,
                         "concurrency": 16})
            rates.append(64 / r["wall"])
            n += 64
        after = thread_cpu(pids)
        after_steps = ray.get([w.stats.remote() for w in workers.values()])
        turns = in_worker_turns(srv, ray, workers, engine_threads, rounds)
    steps = {wn: {k: (b[k] - a[k]) / n for k in STEP_KEYS} for wn, a, b in zip(workers, before_steps, after_steps)}
    return {"req_s": statistics.median(rates), "runs": rates, "requests": n, "steps_per_req": steps,
            "threads": rows_per_thread(before, after, kinds, names, n), "in_worker": turns}


def in_process_rows(runs: int) -> dict:
    """The engine row's waves and the server's closed loop, by turns, on one engine in this process."""
    from engine import Engine, SamplingParams
    from engine.async_engine import AsyncEngine
    eng = Engine.from_pretrained("strata-tiny", **ENGINE)
    sp = SamplingParams(max_new_tokens=SHORT_NEW, ignore_eos=True, temperature=0.0)
    ae = AsyncEngine(eng, "threads-bench")
    tid = ae._thread.native_id

    def cpu() -> float:
        return thread_cpu([os.getpid()])[(os.getpid(), tid)][1]

    def waves(e, ps):   # on the engine thread, as a command: nothing else steps meanwhile
        for w in range(4):
            e.generate(ps[16 * w:16 * (w + 1)], sp)

    async def closed(ps):
        it = iter(ps)

        async def client():
            for p in it:
                async for _ in ae.generate(p, sp):
                    pass
        await asyncio.gather(*(client() for _ in range(16)))

    async def main() -> dict:
        await ae.call(lambda e: waves(e, prompts(16, SHORT, 99)))
        out: dict = {"waves": [], "closed16": []}
        for r in range(runs):
            for key in ("waves", "closed16"):
                ps = prompts(64, SHORT, (1000 if key == "waves" else 5000) + r)
                s0, c0, t = eng.counters["steps"], cpu(), time.perf_counter()
                if key == "waves":
                    await ae.call(lambda e: waves(e, ps))
                else:
                    await closed(ps)
                out[key].append({"req_s": 64 / (time.perf_counter() - t), "cpu_ms_per_req": (cpu() - c0) * 1000 / 64,
                                 "steps_per_req": (eng.counters["steps"] - s0) / 64})
        return {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in out.items()}
    try:
        return asyncio.run(main())
    finally:
        ae.close()   # and the engine


def run_threads(name: str, quick: bool) -> int:
    runs = 2 if quick else 4
    inproc = in_process_rows(runs)
    srv = server_rows(name, runs, rounds=2 if quick else 8)
    print(f"{name}: {srv['req_s']:.0f} req/s (runs {', '.join(f'{x:.0f}' for x in srv['runs'])}); "
          f"CPU ms per short request by thread:")
    print(table([{**r, "cpu_ms_per_req": f"{r['cpu_ms_per_req']:.2f}"} for r in srv["threads"]],
                ["process", "thread", "cpu_ms_per_req"]))
    print("\nper short request: " + "; ".join(
        f"{w} {s['steps']:.2f} steps, {s['decode_tokens'] / max(s['steps'], 1e-9):.1f} decode rows a step"
        for w, s in srv["steps_per_req"].items()))
    print("in one process (the engine's thread): " + "; ".join(
        f"{k} {v['req_s']:.0f} req/s, {v['cpu_ms_per_req']:.2f} ms CPU, {v['steps_per_req']:.2f} steps"
        for k, v in inproc.items()))
    print("by turns with an engine in the worker's process, after a pause (p50; engine thread CPU ms a request): "
          + "; ".join(
        f"{k} on {v['worker']}: HTTP {v['http_p50'] * 1000:.1f} ms against {v['worker_engine_p50'] * 1000:.1f} "
        f"({v['ratio_p50']:.2f}x; back to back {v['worker_engine_b2b_p50'] * 1000:.1f}), CPU "
        f"{v['engine_thread_cpu_ms']['http']:.1f} against {v['engine_thread_cpu_ms']['worker_engine']:.1f} "
        f"(back to back {v['engine_thread_cpu_ms']['worker_engine_b2b']:.1f})" for k, v in srv["in_worker"].items()))
    path = merge_json("overhead", f"threads_{name}", {"load_avg_after": os.getloadavg(), "server": srv,
                                                      "in_process": inproc})
    print(f"wrote {path}")
    return 0
