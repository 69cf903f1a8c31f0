"""``python -m bench.overhead --threads``: where a server's short requests spend CPU, thread by thread, and how
its workers batch them, against the same requests in one process.

The server (``--configs``: colocated by default) runs the bench's short load (64 requests of 32 tokens, 8 new,
16 in flight, closed loop) a few times. Each thread of each of its processes (and of the load generator) has
its CPU (/proc/<pid>/task/<tid>/stat) per request, named by the process's kind and the thread's Python name
(asked of each named actor through ``__ray_call__``; a thread Python did not start keeps its OS name). Each
worker says its engine steps and decode rows per request (``stats()``). In this process the same engine
settings run the same requests as the engine row does (4 waves of 16, on the engine's own thread) and as the
server gets them (``AsyncEngine``, 16 in flight): the engine thread's CPU and its steps per request.

What this showed (session 45, colocated, the worker unbound): the worker's engine thread is the bound,
6.3-8.4 ms of CPU per short request against 5.2-6.2 in one process either way, the same CPU per step; the
server's steps hold ~10 decode rows where one process's hold ~14-16 (each request is out of the worker for
its HTTP round trips), so 0.58-0.71 steps per request against 0.50-0.52. Merged into
bench/results/overhead.json as ``threads_<config>``."""
from __future__ import annotations

import asyncio
import collections
import os
import statistics
import threading
import time

from bench.common import merge_json, table
from bench.overhead import CLK, ENGINE, SHORT, SHORT_NEW, _cmdline, descendants, joined, kind_of, prompts

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


def server_rows(name: str, runs: int) -> dict:
    with joined(name) as (srv, ray):
        names: dict[int, str] = {}
        workers = {}
        for a in ray.util.list_named_actors(all_namespaces=True):
            handle = ray.get_actor(a["name"], namespace=a["namespace"])
            try:
                _, threads = ray.get(handle.__ray_call__.remote(python_threads), timeout=30)
            except Exception:  # noqa: BLE001 - an actor that cannot answer keeps its threads' OS names
                continue
            names.update(threads)
            if a["namespace"] == "strata" and a["name"] not in ("strata-router", "strata-storage"):
                workers[a["name"]] = handle
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
    steps = {wn: {k: (b[k] - a[k]) / n for k in STEP_KEYS} for wn, a, b in zip(workers, before_steps, after_steps)}
    return {"req_s": statistics.median(rates), "runs": rates, "requests": n, "steps_per_req": steps,
            "threads": rows_per_thread(before, after, kinds, names, n)}


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
    srv = server_rows(name, runs)
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
    path = merge_json("overhead", f"threads_{name}", {"load_avg_after": os.getloadavg(), "server": srv,
                                                      "in_process": inproc})
    print(f"wrote {path}")
    return 0
