"""What the serving stack costs beside the engine (issue #37): the same requests through one in-process
``Engine`` (the server's engine settings) and through ``strata serve`` over HTTP, colocated (1 worker),
default 1P+1D and 2P+1D with prefix routing, with p50/p90/p99 and the CPU seconds per request that each
process kind spends (proxy, ingress, router, workers, Ray's own, and the load generator, which shares
the cores).

    python -m bench.overhead [--quick] [--configs engine,colocated,1p1d,2p1d] [--label now]
    python -m bench.overhead --profile [--configs 1p1d] [--profile-seconds 20]   # py-spy + Ray calls per request (bench/overhead_profile.py)
    python -m bench.overhead --hops [--quick] [--configs colocated-l1]   # each hop's round trip (overhead_hops.py)
    python -m bench.overhead --timeline [--quick]   # one request's marks across its processes (overhead_timeline.py)
    python -m bench.overhead --fileio [--quick] [--configs colocated]   # the L3 file store's batch (overhead_fileio.py)
    python -m bench.overhead --threads [--quick] [--configs colocated]   # CPU by thread, steps (overhead_threads.py)

Every HTTP row uses one out-of-process load generator (bench/overhead_client.py): /generate with
``input_ids``, greedy, ``ignore_eos``. Each server is ``python -m cluster.cli serve`` on a fresh local
Ray cluster (own STRATA_HOME, free port); its processes' CPU times come from /proc/<pid>/stat
(utime+stime) of every descendant before and after each phase, named by their Ray process titles
(ray::ProxyActor, ray::ServeReplica:...:ingress, ray::PrefixRouterActor, ray::WorkerActor, ...).
Short requests over HTTP run closed-loop, 16 in flight; the engine runs them as 4 waves of 16 (and one
batch of 64). When the run has the engine row, the engine alone is measured again right after each config
(its server stopped), and the config is shown against that too: on a shared VM the machine's speed moves by
half within minutes, which one engine row at the start cannot show. Each config also runs the cached TTFT and
the 64-token request by turns with an engine in this process (``by_turns``). Writes bench/results/overhead.json
(``--profile``: overhead_profile.json).

Findings before #37 [fastpath] (Serve's Python proxy in front, one Ray streamed object per token; 2 cores
shared with other jobs, so timings are noisy; profile in overhead_profile.json, taken then):
- The cluster was CPU-bound, not wait-bound: a short request (32 tokens, 8 new) cost ~28-35 ms of CPU
  colocated (1P+1D ~34-44) against ~2.8 ms in the engine alone: proxy ~4-4.5 ms, ingress ~8, router ~1,
  worker ~11 (its engine ~3), Ray's daemons ~1, load generator ~1.5.
- Ray messages per request: proxy -> replica 1 call, replica -> proxy 2 (receive_asgi_messages), ingress
  -> router 1, ingress -> worker 1; then one streamed Ray object per token worker -> ingress and one per
  response chunk ingress -> proxy. The per-token cost (~1 ms) sat in the worker: each item crossed the
  engine thread, the actor's asyncio loop and Ray's executor (pickled) before leaving.
- Hop by hop: bare actor call 0.8 ms, router.route 1.0, the worker's stream alone 6-7 ms for one new token
  (engine 2.2), GET /v1/models 5.5-9 ms (the proxy's floor), HTTP /generate 17-22 ms.

What #37 changed, and what is left (after; README "Serving overhead" has both tables):
- HTTP front: HAProxy (Ray Serve's direct ingress, ``server.front: haproxy``): the replica serves HTTP
  itself; GET /v1/models 5.7 -> 0.9 ms, the front's CPU per request 4 -> 0.3-0.6 ms, the ingress's 7.7 ->
  2.1 ms (no receive_asgi_messages round trips, no per-chunk objects back to a proxy).
- Tokens: the token channel (actors/token_channel.py), one ZMQ message per engine step and ingress replica
  sent by the engine thread itself; one Ray call per request (submit), for failure and cancellation. The
  worker's path for 64 tokens 0.148 s (streamed) -> 0.109 s (engine 0.098); per token ~0.16 ms over the
  engine.
- The route over ZMQ (actors/route_channel.py): the router actor answers route on its own socket (~0.12
  ms a round trip against ~1 ms for its Ray call, which stays the fallback); the router's CPU per request
  ~1.3 -> ~0.5 ms.
- A request served by one worker goes to it over its token channel (ChannelClient.submit: PUSH -> the
  worker's PULL -> the engine thread), no Ray call: a dead worker is seen by the channel's connection
  dropping (or its heartbeats stopping). (P/D: session 20, below.)
- P/D: the prefill worker has the decode worker reserve the pages during its own prefill (the ingress names
  the lease: actors/handoff.py), one round trip off the TTFT path.
- A trace of one colocated request (1 new token, cached 512-token prompt) before these three: client ->
  HTTP in 1.3 ms (httpx, HAProxy, uvicorn), FastAPI + parsing 0.5, route 1.8 (of which the router's own
  work ~0.05), submit 1.2 (0.33 in the caller), engine step, channel back 0.3, HTTP out ~1.4.
- The write-through (session 18): per-thread CPU from /proc showed the worker's copier thread at ~3 ms per
  short request. On a CPU a second thread's L1 <-> L2 copies only pass the GIL back and forth with the
  forward (engine alone with the server's tiers: 4.7 -> 4.0 ms per short request with them in place), so
  they now run in place on a CPU (storage/copier.py); the file L3's I/O threads serve only batches of
  >= 1 MiB, and an L3 page already stored is not written again. The rest was the disk (next point).
  Workers' CPU per short request, colocated, full runs: 7.9 -> 5.4 ms.
- This machine's disk: ext4 without a journal skips inodes deleted in the last 1-6 minutes when it
  creates a file (perf: __ext4_new_inode -> find_inode_bit -> recently_deleted), so after thousands of
  deletions an L3 page costs 0.2-0.8 ms of CPU to create instead of ~0.05. The servers' directories are
  removed when the bench ends, not between configs (``--keep-homes`` leaves them, for a run right after
  another); a file L3 that evicts (unlinks) pages under load pays the same. The table's row "a new 8 KiB
  file, CPU us" (``file_create_us``, before and after each config) says which state a run met (session 45).
- Session 19: the load generator sends with aiohttp (what SGLang's bench_serving and vLLM's
  benchmark_serving use); httpx cost ~1 ms more of the client's CPU and ~1 ms more latency per request
  (``--http httpx`` keeps it). A trace of one colocated request (1 new token, cached 512-token prompt, a
  raw-socket client): client -> the replica's ASGI app 0.47 ms (HAProxy, uvicorn), FastAPI and parsing
  0.39, route over ZMQ 0.41, submit -> the engine thread 0.28, the engine step 3.1 (its alone ~2.1-2.2:
  the step after an idle gap costs more on this VM, 2.9 ms after 10 ms idle even in one process), channel
  back 0.23, the answer 0.25 + 0.3 out. Inside a worker a 64-token request's steps take ~11% more thread
  CPU than in one process (task-clock 95.9 against 86.5 ms); ~5% of it was the channel send each step
  (ZMQ's I/O thread woken per step), now gone for non-streamed requests: their items leave merged
  (engine/async_engine.py WHOLE_SEND_TOKENS, SGLang's force-stream interval). A P/D request that ends at
  its first token stays on its prefill worker (no lease, no transfer); the streamed TTFT row measures the
  handed-off one: its prefill_to Ray call costs ~1.9 ms in and ~3 ms back against ~0.3 over a channel.
- Left, colocated (TTFT ~5-6.5 ms against the engine's ~2): HTTP in and out through HAProxy (~2.5 ms with
  the load generator's own client), and the engine step inside a worker that shares 2 cores with every
  other process: its steps take ~7% more CPU than the engine's alone (1.40 against 1.32 ms for one decode
  row, measured inside the worker), its first step of a cached prompt ~0.6 ms more. Short requests: ~9 ms
  of CPU each (workers ~5.4 with the engine's ~2.5, ingress 1.5, the load generator 1.2), ~165-195 req/s.
- Session 20, P/D over the token channels: the ingress sends one HANDOFF to the prefill worker's channel
  (no Ray call from the ingress), the prefill worker answers the first token there and hands the decode
  half to the decode worker itself (its Ray call carries the receipt), whose items come over its own
  channel. The handed-off request's first chunk no longer waits for prefill_to's Ray return and the
  decode no longer starts after a round trip through the ingress. py-spy (``--profile --configs 1p1d``)
  then showed Ray pickling the ray_object payload's tensors through torch's storage serialisation on both
  workers (~14% of their CPU); the payload now pickles its KV as raw byte arrays (out of band under pickle
  5): the workers' CPU per short request 13.0 -> 10.3 ms in the profile's run.
- Then (session 21): the decode worker offloads only the pages it computed (the prompt's are the prefill
  worker's write-through to the same L3 store: ``KVPayload.offloaded_pages`` / ``offloaded_to``), and the
  decode half goes prefill -> decode worker as one LEASED message on the decode worker's channel instead
  of the ``submit_leased`` Ray call. Profile (``--profile --configs 1p1d``, a ~3x slower machine): the
  workers' CPU per short request 38.1 -> 28.2 ms; Ray's share of it 17% -> 10%.
- Then (session 22): the prefill worker reserves the lease over the decode worker's channel (RESERVE on
  its request endpoint, the Destination back on the prefill worker's own DEALER to it), so no Ray call is
  left on a request's path; Ray's share of the workers' CPU in the profile 9.3% -> 4.9% (what is left of
  it is the workers' reports to the router, 20 a second each). The ingress replica runs the HTTP app on
  Serve's own event loop (RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0, cluster/launch.py): no thread
  hop per request and per item; the ingress's CPU per sequential request over the worker's 0.41-0.42 ->
  0.36 (six alternating runs), ~12% less.
- Then (session 23): write-through in batches (one L1 -> L2 copy per component and one L3 store batch per
  step, not per prompt: the in-process engine with the server's tiers 11.7% -> 2.5% of its step in
  write-through), L3 lookups only past ``prefetch_min_tokens`` (256) beyond L1/L2 (a short prompt no
  longer waits one schedule for one), and the workers' reports over the router's route channel instead
  of a Ray call every 50 ms each (the router's CPU per short request 0.81 -> 0.57 ms in the profile).
- Then (session 24): a step's one-token rows padded in one tensor call per field (engine/runner.py), not
  per row: 16 rows 1.27 -> 0.52 ms of the step. Under the HTTP short load the colocated worker's engine
  thread was 9.8 ms of CPU per request (11.1-12.0 in session 23), the copier thread's L3 writes 1.0 ms.
- Then (session 25): a cached 512-token prompt's path, hop by hop on one monotonic clock (p50 of 40,
  colocated; step 11.7 ms): client -> uvicorn 1.35 ms (httpx, HAProxy), Serve + FastAPI to the handler
  1.08, the handler to the route 0.38, the route over ZMQ 1.05, the token channel to the worker 0.55 and to
  the engine thread 0.39; back: the engine's send 0.28, the channel to the ingress 0.72, the handler 0.21,
  FastAPI's answer 0.40, HAProxy and the client 1.1. A cross-process hop costs 0.5-1 ms here (threads
  woken from idle): the route's round trip is ~0.12 ms when routes follow each other (--hops). Serve's access
  line (the replica's log file, and its stderr, which Ray's log monitor reads and publishes) is off unless
  ``server.access_log``: ~0.35 ms of CPU per request (ingress and Ray's processes).
- Then (session 26): while the router's last answer was its only choice (``Route.alone``: colocated, 1P+1D),
  the ingress sends a request at once and asks the router meanwhile: the route (~1.4 ms with the hashing)
  overlaps the step. Full pair, TTFT p50 base -> head: colocated 20.1 -> 15.1 ms, 1P+1D 17.9 -> 15.5.
- Then (session 27): a colocated worker's engine thread reads its token channel's request socket itself
  (one thread woken per request, not two); over the channel alone, cached TTFT p50 ~0.8 ms lower.
- Left, 1P+1D: two engines' steps (the decode worker's own batches), the file L3's per-page writes (a temp
  file, a write and a rename each, ~100 us of CPU a page here), the workers' ``l3_stored`` Ray calls.
- Then (session 38): the file L3 store's system calls for a batch (a stat and a utime per page already
  stored; an open, a pwritev, a close and a rename per new one) are made by storage/l3/_fileio.c with the
  GIL released once. Each ``os.*`` call on the worker's copier thread had released the GIL and waited for
  the stepping engine thread to hand it back. The engine alone with the server's tiers, the store's two
  ways by turns in one process (40 rounds): 0.899 against 0.834 of the L1-only engine's short-request rate,
  its process CPU 5.17 against 5.67 ms a request. ``--fileio`` measures both ways in a server's workers.
- A slow reader (4 KB socket buffer, 3 s late, ~1 MB of SSE) does not hold others back: its output is
  buffered per client and the others' latency matches the prompt-reader case.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import yaml

from bench.common import merge_json, table
from bench.overhead_client import HTTP_CLIENTS
from tests.util import free_port

ROOT = Path(__file__).resolve().parent.parent
HOOKS = Path(__file__).resolve().parent / "overhead_hooks"
CLK = os.sysconf("SC_CLK_TCK")
LONG, SHORT, SHORT_NEW, LONG_NEW, STREAM_NEW = 512, 32, 8, 64, 16
CONFIGS = {   # overrides of cluster/configs/default.yaml (the engine settings stay the default's)
    "colocated": {"workers": {"colocated": 1, "prefill": 0, "decode": 0}},
    "1p1d": {},
    "2p1d": {"workers": {"prefill": 2, "decode": 1}, "router": {"policy": "prefix"}},
    # Not in the default run: colocated without the host/L3 tiers, as the engine-alone row runs (so the
    # difference to "colocated" is what L2/L3 write-through of every new prompt costs the worker).
    "colocated-l1": {"workers": {"colocated": 1, "prefill": 0, "decode": 0}, "engine": {"hicache": None}},
    # Not in the default run either: workers the OS places (actors/cpu_binding.py), for an A/B of binding.
    "colocated-unbound": {"workers": {"colocated": 1, "prefill": 0, "decode": 0, "cpu_binding": "off"}},
    "1p1d-unbound": {"workers": {"cpu_binding": "off"}},
    "2p1d-unbound": {"workers": {"prefill": 2, "decode": 1, "cpu_binding": "off"}, "router": {"policy": "prefix"}},
}
# The server's engine settings (cluster/configs/default.yaml) without its host/L3 tiers.
ENGINE = dict(page_size=16, num_pages=2048, max_batch_tokens=512, max_running_requests=64, torch_threads=1,
              enable_prefix_cache=True, swa_full_ratio=0.5)
KINDS = ("proxy", "ingress", "router", "workers", "storage", "serve_controller", "ray_system", "launcher",
         "client")
REPS = {  # (ttft n, 64-token n, short runs, /v1/models n, 64-stream runs, slow runs, idle s, by-turns rounds)
    "quick": dict(ttft=20, long=4, short=1, models=40, streams=1, slow=1, idle=2.0, turns=6),
    "full": dict(ttft=100, long=15, short=3, models=200, streams=3, slow=2, idle=5.0, turns=20),
}


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(length)] for _ in range(n)]


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def dist(xs: list[float], scale: float = 1000.0) -> dict:
    """p50/p90/p99/mean (x ``scale``: ms by default) and n."""
    return {"p50": pct(xs, 50) * scale, "p90": pct(xs, 90) * scale, "p99": pct(xs, 99) * scale,
            "mean": statistics.fmean(xs) * scale if xs else float("nan"), "n": len(xs)}


# ---- the engine alone ----------------------------------------------------------------------------------
def engine_rows(reps: dict) -> dict:
    import torch  # noqa: F401 - the engine's
    from engine import Engine, SamplingParams
    eng = Engine.from_pretrained("strata-tiny", **ENGINE)
    long = prompts(1, LONG, 1)[0]
    one = SamplingParams(max_new_tokens=1, ignore_eos=True, temperature=0.0)
    sp = lambda n: SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.0)  # noqa: E731
    for _ in range(3):
        eng.generate(long, one)
    eng.generate(prompts(16, SHORT, 99), sp(SHORT_NEW))
    out: dict = {}

    def timed(fn, n):
        lat, c0 = [], time.process_time()
        for _ in range(n):
            t = time.perf_counter()
            fn()
            lat.append(time.perf_counter() - t)
        return lat, (time.process_time() - c0) / n

    lat, cpu = timed(lambda: eng.generate(long, one), reps["ttft"])
    out["ttft_cached"] = {**dist(lat), "cpu_ms_per_req": cpu * 1000}
    lat, cpu = timed(lambda: eng.generate(long, sp(LONG_NEW)), reps["long"])
    out["long64"] = {**dist(lat, 1.0), "cpu_s_per_req": cpu}
    waves, batch = [], []
    for r in range(reps["short"]):
        ps = prompts(64, SHORT, 1000 + r)
        t = time.perf_counter()
        for w in range(4):
            eng.generate(ps[16 * w:16 * (w + 1)], sp(SHORT_NEW))
        waves.append(64 / (time.perf_counter() - t))
        ps = prompts(64, SHORT, 2000 + r)
        t = time.perf_counter()
        eng.generate(ps, sp(SHORT_NEW))
        batch.append(64 / (time.perf_counter() - t))
    out["short"] = {"req_s": statistics.median(waves), "runs": waves}
    out["short_batch64"] = {"req_s": statistics.median(batch), "runs": batch}
    ttfts = []
    for r in range(reps["streams"]):
        ps = prompts(64, SHORT, 3000 + r)
        t = time.perf_counter()
        rids = [eng.add_request(p, sp(STREAM_NEW)) for p in ps]
        first: dict[str, float] = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.new_token_ids and o.rid not in first:
                    first[o.rid] = time.perf_counter() - t
        ttfts += [first[r_] for r_ in rids]
        for r_ in rids:
            eng.pop_finished(r_)
    out["streams64"] = {"ttft": dist(ttfts)}
    eng.close()
    return out


def engine_again(reps: dict) -> dict:
    """The engine alone again, in the minute right after a config's phases (its server stopped): the engine
    row's cached TTFT, 64-token request and short waves. The ratios stay against the engine row, as the
    issue defines them; this one shows whether the machine's speed moved since it was measured (on a shared
    VM it moves by half within minutes), beside each config."""
    e = engine_rows(reps)
    return {k: e[k] for k in ("ttft_cached", "long64", "short")}


# ---- processes and their CPU times ---------------------------------------------------------------------
def machine_ticks() -> tuple[int, int]:
    """(stolen, all) CPU ticks of the machine so far (/proc/stat): on a shared VM the time the hypervisor gave
    this guest's vCPUs to others, which slows every row alike and moves from one hour to the next."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]   # user nice system idle iowait irq softirq steal
    return v[7], sum(v)


def steal_pct(before: tuple[int, int], after: tuple[int, int]) -> float:
    total = after[1] - before[1]
    return 100.0 * (after[0] - before[0]) / total if total > 0 else 0.0


def file_create_us(n: int = 200, page_bytes: int = 8192) -> float:
    """CPU us per new file (created, one page written, renamed onto its name: the file L3 store's write of a
    page) in a fresh directory beside the servers' homes. On this machine's journal-less ext4 it is ~60-100
    us, and several times that for minutes after thousands of files were removed (ext4's scan past recently
    deleted inodes when it allocates one): a colocated worker's copier spent 1.9 ms of CPU per short request
    then, 0.55 in a calmer minute. The files stay until the homes go (a removal now would slow what follows)."""
    d = tempfile.mkdtemp(prefix="sovf")
    _HOMES.append(d)
    buf = bytes(page_bytes)
    c0 = time.thread_time()   # this thread's CPU in ns (getrusage's split of it counts in ticks)
    for i in range(n):
        tmp = os.path.join(d, f".{i}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
        os.rename(tmp, os.path.join(d, str(i)))
    return 1e6 * (time.thread_time() - c0) / n


def _stat(pid: int) -> tuple[int, float] | None:
    """(ppid, utime+stime seconds) of ``pid``, None if gone."""
    try:
        s = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = s[s.rindex(")") + 2:].split()
    return int(f[1]), (int(f[11]) + int(f[12])) / CLK


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def kind_of(cmd: str) -> str:
    # The HTTP front: Serve's proxy, or (server.front haproxy) HAProxy and the actor that runs it.
    if "ray::ProxyActor" in cmd or "ray::HAProxyManager" in cmd or "bin/haproxy " in cmd:
        return "proxy"
    if "ray::ServeReplica" in cmd:
        return "ingress"
    if "ray::PrefixRouterActor" in cmd:
        return "router"
    if "ray::WorkerActor" in cmd:
        return "workers"
    if "ray::StorageActor" in cmd:
        return "storage"
    if "ray::ServeController" in cmd:
        return "serve_controller"
    if "cluster.cli" in cmd:
        return "launcher"
    return "ray_system"   # gcs_server, raylet, agents, idle workers, log monitor


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(int(d))
            if st is not None:
                children.setdefault(st[0], []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


class CpuMeter:
    """CPU seconds of every process under the server's launcher, and of the load generator, per kind."""

    def __init__(self, server_pid: int, client_pid: int) -> None:
        self.server_pid, self.client_pid = server_pid, client_pid
        self.kinds: dict[int, str] = {}

    def sample(self) -> dict[int, float]:
        out = {}
        for pid in descendants(self.server_pid) + [self.client_pid]:
            st = _stat(pid)
            if st is None:
                continue
            if pid not in self.kinds or self.kinds[pid] == "ray_system":   # an idle worker may become an actor
                self.kinds[pid] = "client" if pid == self.client_pid else kind_of(_cmdline(pid))
            out[pid] = st[1]
        return out

    def delta(self, before: dict[int, float], after: dict[int, float]) -> dict[str, float]:
        by = {k: 0.0 for k in KINDS}
        for pid, c in after.items():
            by[self.kinds.get(pid, "ray_system")] += c - before.get(pid, 0.0)
        return by

    def pids(self, kind: str) -> list[int]:
        self.sample()
        return [p for p, k in self.kinds.items() if k == kind and _stat(p) is not None]


# ---- one server ----------------------------------------------------------------------------------------
class Server:
    """``strata serve`` on a fresh local Ray cluster, and the load generator beside it."""

    def __init__(self, name: str, timeout: float = 300.0, calls_dir: str | None = None,
                 switch_interval: float | None = None, http: str = "aiohttp", timeline_dir: str | None = None) -> None:
        self.name = name
        self.home = tempfile.mkdtemp(prefix="sov")   # short: Ray's socket paths must fit 107 bytes
        cfg = yaml.safe_load((ROOT / "cluster" / "configs" / "default.yaml").read_text())
        for section, over in CONFIGS[name].items():
            cfg.setdefault(section, {}).update(over)
        self.port = free_port()
        cfg["server"]["port"] = self.port
        path = os.path.join(self.home, "cluster.yaml")
        Path(path).write_text(yaml.safe_dump(cfg))
        env = {**os.environ, "STRATA_HOME": self.home, "RAY_TMPDIR": os.path.join(self.home, "r"),
               "PYTHONUNBUFFERED": "1"}
        if calls_dir:
            env["STRATA_OVERHEAD_CALLS"] = calls_dir
        if switch_interval:
            env["STRATA_OVERHEAD_SWITCH_INTERVAL"] = str(switch_interval)
        if timeline_dir:
            env["STRATA_OVERHEAD_TIMELINE"] = timeline_dir
        if calls_dir or switch_interval or timeline_dir:
            env["PYTHONPATH"] = os.pathsep.join([str(HOOKS), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        os.makedirs(env["RAY_TMPDIR"], exist_ok=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.lines: list[str] = []
        t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--config", path], cwd=ROOT,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")), daemon=True).start()
        self.client = None
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - t0
        self.client = subprocess.Popen([sys.executable, "-m", "bench.overhead_client", "--url", self.url, "--http", http],
                                       cwd=ROOT,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.meter = CpuMeter(self.proc.pid, self.client.pid)

    def _wait_healthy(self, timeout: float) -> None:
        import httpx
        t0 = time.monotonic()
        with httpx.Client(timeout=5) as c:
            while time.monotonic() - t0 < timeout:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name}: strata serve exited:\n" + "".join(self.lines[-30:]))
                try:
                    if c.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        raise TimeoutError(f"{self.name}: not healthy in {timeout:.0f}s:\n" + "".join(self.lines[-30:]))

    def ray_address(self, timeout: float = 30.0) -> str:
        """The GCS address the launcher prints once it serves (/health may answer 200 a moment before)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            for ln in list(self.lines):
                if "strata: Ray at " in ln:
                    return ln.split("Ray at ")[1].split()[0]
            time.sleep(0.1)
        raise TimeoutError(f"{self.name}: the launcher never said where Ray is:\n" + "".join(self.lines[-30:]))

    def ask(self, cmd: dict) -> dict:
        self.client.stdin.write(json.dumps(cmd) + "\n")
        self.client.stdin.flush()
        out = json.loads(self.client.stdout.readline())
        if not out.get("ok"):
            raise RuntimeError(f"{self.name}: {cmd['op']} failed: {out.get('error')}")
        return out

    def phase(self, cmd: dict, requests: int) -> tuple[dict, dict]:
        """Run ``cmd``; returns (its answer, CPU ms per request by process kind)."""
        before = self.meter.sample()
        out = self.ask(cmd)
        cpu = self.meter.delta(before, self.meter.sample())
        return out, {k: v * 1000 / requests for k, v in cpu.items()}

    def stop(self) -> None:
        if self.client is not None and self.client.poll() is None:
            try:
                self.client.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.client.stdin.flush()
                self.client.wait(10)
            except Exception:  # noqa: BLE001
                self.client.kill()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # Ray's session files and the L3 store's pages go when the bench ends, not now: on a journal-less
        # ext4 (this machine's), creating a file scans past every inode deleted in the last 1-6 minutes
        # (ext4's recently_deleted), and removing thousands of L3 pages here made the next server's L3
        # writes cost 0.5-0.8 ms of CPU per page instead of ~0.05.
        _HOMES.append(self.home)


_HOMES: list[str] = []


@atexit.register
def _remove_homes() -> None:
    import shutil
    for home in _HOMES:
        shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def joined(name: str) -> Iterator[tuple[Server, Any]]:
    """A fresh ``name`` server after 16 short requests at once (every path taken), and this process joined
    to its Ray cluster as a driver (to reach its actors); yields (server, the ``ray`` module), and leaves
    the cluster and stops the server after."""
    from cluster.launch import set_ray_env
    set_ray_env()
    import ray
    srv = Server(name)
    try:
        srv.ask({"op": "requests", "prompts": prompts(16, SHORT, 99), "max_new": SHORT_NEW, "concurrency": 16})
        ray.init(address=srv.ray_address(), namespace="strata", log_to_driver=False)
        yield srv, ray
    finally:
        try:
            ray.shutdown()
        finally:
            srv.stop()


def by_turns(srv: Server, rounds: int) -> dict:
    """The cached TTFT and the 64-token request over HTTP and in an engine of this process (the server's engine
    settings, the engine row's call) by turns, the order swapped every round, so that both meet the same
    minute of the machine. The engine runs beside the idle server (whose idle load cost the engine ~2% in
    session 42), and after the HTTP request's pause as the server's worker does after the client's (a step
    after an idle gap costs more on this VM). Not the targets' rows: those compare absolute figures taken
    apart; this says what the stack adds when the machine's drift is taken out."""
    from engine import Engine, SamplingParams
    eng = Engine.from_pretrained("strata-tiny", **ENGINE)
    long = prompts(1, LONG, 1)[0]
    out: dict = {}
    try:
        for key, new in (("ttft_cached", 1), ("long64", LONG_NEW)):
            sp = SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=0.0)
            eng.generate(long, sp)
            lat: dict[str, list[float]] = {"http": [], "engine": []}
            for r in range(rounds):
                for side in ("http", "engine") if r % 2 == 0 else ("engine", "http"):
                    if side == "http":
                        a = srv.ask({"op": "requests", "prompts": [long], "max_new": new, "concurrency": 1})
                        lat[side].append(a["latency"][0])
                    else:
                        t = time.perf_counter()
                        eng.generate(long, sp)
                        lat[side].append(time.perf_counter() - t)
            ratios = sorted(h / e for h, e in zip(lat["http"], lat["engine"]))
            out[key] = {"http_p50": statistics.median(lat["http"]), "engine_p50": statistics.median(lat["engine"]),
                        "paired_ratio_p50": ratios[len(ratios) // 2], "rounds": rounds}
    finally:
        eng.close()
    return out


def _sum_cpu(parts: list[dict]) -> dict:
    return {k: statistics.fmean(p[k] for p in parts) for k in parts[0]}


def http_rows(name: str, reps: dict, http: str = "aiohttp") -> dict:
    srv = Server(name, http=http)
    try:
        return _http_rows(srv, reps)
    finally:
        srv.stop()


def _http_rows(srv: Server, reps: dict) -> dict:
    long = prompts(1, LONG, 1)[0]
    out: dict = {"start_s": srv.start_s}
    # Warm-up: the prompt cached (everywhere it goes), every path taken once.
    srv.ask({"op": "requests", "prompts": [long] * 3, "max_new": 1, "concurrency": 1})
    srv.ask({"op": "requests", "prompts": prompts(16, SHORT, 99), "max_new": SHORT_NEW, "concurrency": 16})
    srv.ask({"op": "streams", "prompts": prompts(4, SHORT, 98), "max_new": 2})
    srv.ask({"op": "models", "n": 3})
    before = srv.meter.sample()
    time.sleep(reps["idle"])
    idle = srv.meter.delta(before, srv.meter.sample())
    out["idle_cpu_ms_per_s"] = {k: v * 1000 / reps["idle"] for k, v in idle.items()}

    r, cpu = srv.phase({"op": "models", "n": reps["models"]}, reps["models"])
    out["models"] = {**dist(r["latency"]), "cpu_ms_per_req": cpu}
    r, cpu = srv.phase({"op": "requests", "prompts": [long] * reps["ttft"], "max_new": 1, "concurrency": 1},
                       reps["ttft"])
    out["ttft_cached"] = {**dist(r["latency"]), "cpu_ms_per_req": cpu}
    # The same prompt streamed with 8 new tokens: its first chunk. In P/D this is the handed-off request's
    # TTFT (a 1-token request has no decode phase and stays on its prefill worker, actors/handoff.py).
    r = srv.ask({"op": "stream_seq", "prompts": [long] * reps["ttft"], "max_new": SHORT_NEW})
    out["ttft_streamed"] = {**dist(r["ttft"]), "wrong_length": r["wrong_length"]}
    r, cpu = srv.phase({"op": "requests", "prompts": [long] * reps["long"], "max_new": LONG_NEW, "concurrency": 1},
                       reps["long"])
    out["long64"] = {**dist(r["latency"], 1.0), "cpu_ms_per_req": cpu, "wrong_length": r["wrong_length"]}
    out["by_turns"] = by_turns(srv, reps["turns"])
    rates, cpus, bad = [], [], 0
    for i in range(reps["short"]):
        r, cpu = srv.phase({"op": "requests", "prompts": prompts(64, SHORT, 1000 + i), "max_new": SHORT_NEW,
                            "concurrency": 16}, 64)
        rates.append(64 / r["wall"])
        cpus.append(cpu)
        bad += r["wrong_length"]
    out["short"] = {"req_s": statistics.median(rates), "runs": rates, "cpu_ms_per_req": _sum_cpu(cpus),
                    "wrong_length": bad}
    ttfts, cpus = [], []
    for i in range(reps["streams"]):
        r, cpu = srv.phase({"op": "streams", "prompts": prompts(64, SHORT, 3000 + i), "max_new": STREAM_NEW}, 64)
        ttfts += r["ttft"]
        cpus.append(cpu)
    out["streams64"] = {"ttft": dist(ttfts), "cpu_ms_per_req": _sum_cpu(cpus)}
    # The others alone, beside one 512-token stream read as it comes (what sharing the batch costs), and
    # beside the same stream read only after 3 s (what a slow reader adds on top: should be nothing).
    lat: dict[str, list[float]] = {"alone": [], "beside_reader": [], "beside_slow_reader": []}
    slow = []
    for i in range(reps["slow"]):
        for j, (key, delay) in enumerate((("alone", None), ("beside_reader", 0.0), ("beside_slow_reader", 3.0))):
            cmd = {"op": "slow", "prompts": prompts(15, SHORT, 4000 + 10 * i + j), "max_new": 32}
            if delay is not None:
                cmd.update(slow_prompt=prompts(1, SHORT, 6000 + 10 * i + j)[0], slow_max_new=512, slow_delay=delay)
            r = srv.ask(cmd)
            lat[key] += r["latency"]
            if delay:
                slow.append(r["slow"])
    out["slow_reader"] = {**{k: dist(v) for k, v in lat.items()}, "slow": slow}
    # Idle again, the store now holding every page the phases wrote: what the background passes cost
    # (the storage actor's rescan once cost CPU in proportion to the pages in L3, every second).
    time.sleep(1.5)   # the last requests' write-through lands
    before = srv.meter.sample()
    time.sleep(reps["idle"])
    idle = srv.meter.delta(before, srv.meter.sample())
    out["idle_after_cpu_ms_per_s"] = {k: v * 1000 / reps["idle"] for k, v in idle.items()}
    out["l3_pages_after"] = sum(len(files) for _, _, files in os.walk(os.path.join(srv.home, "l3")))
    return out


# ---- the report ----------------------------------------------------------------------------------------
def _cell(name: str, res: dict, key: str, eng: dict | None) -> str:
    r = res.get(name)
    if r is None or key not in r and key != "slow":
        return "-"
    if key in ("ttft_cached", "ttft_streamed"):
        x = r[key if name != "engine" else "ttft_cached"]   # the engine's first token is the same step
        return f"{x['p50']:.1f} / {x['p90']:.1f} / {x['p99']:.1f}"
    if key == "long64":
        x = r[key]
        ratio = f" ({x['p50'] / eng['long64']['p50']:.2f}x)" if eng and name != "engine" else ""
        return f"{x['p50']:.3f}{ratio}"
    if key == "short":
        x = r[key]["req_s"]
        ratio = f" ({x / eng['short']['req_s']:.2f}x)" if eng and name != "engine" else ""
        return f"{x:.0f}{ratio}"
    if key == "models":
        return f"{r[key]['p50']:.1f}"
    if key == "streams64":
        x = r[key]["ttft"]
        return f"{x['p50']:.0f} / {x['p99']:.0f}"
    if key == "slow":
        s = r.get("slow_reader")
        if s is None:
            return "-"
        return "->".join(f"{s[k]['p50']:.0f}/{s[k]['p99']:.0f}" for k in ("alone", "beside_reader", "beside_slow_reader"))
    return "-"


def _against(r: dict, e: dict) -> str:
    """A config's cached TTFT over the engine's, and its 64-token and short ratios, against engine rows ``e``."""
    return (f"{r['ttft_cached']['p50'] - e['ttft_cached']['p50']:+.1f}, "
            f"{r['long64']['p50'] / e['long64']['p50']:.2f}x, {r['short']['req_s'] / e['short']['req_s']:.2f}x")


def report(res: dict) -> str:
    names = [n for n in ("engine", *CONFIGS) if n in res]
    eng = res.get("engine")
    rows = [("TTFT, cached 512-tok prompt, 1 new: p50/p90/p99 ms", "ttft_cached"),
            ("  the same streamed, 8 new: first chunk p50/p90/p99", "ttft_streamed"),
            ("64 new after it: request p50 s (x engine)", "long64"),
            ("64 short (32 tok, 8 new), 16 at once: req/s (x eng.)", "short"),
            ("GET /v1/models p50 ms", "models"),
            ("64 streams at once (16 new): TTFT p50/p99 ms", "streams64"),
            ("15 streams p50/p99 ms: alone->+reader->+slow reader", "slow")]
    out = [{"what": label, **{n: _cell(n, res, key, eng) for n in names}} for label, key in rows]
    if eng:
        out.append({"what": "engine: the 64 short as one batch: req/s", "engine": f"{eng['short_batch64']['req_s']:.0f}"})
        again = {n: res[n]["engine_after"] for n in names[1:] if "engine_after" in res[n]}
        if again:
            out.append({"what": "the engine again right after: TTFT ms, 64 new s, short", **{
                n: f"{a['ttft_cached']['p50']:.1f}, {a['long64']['p50']:.3f}, {a['short']['req_s']:.0f}"
                for n, a in again.items()}})
            out.append({"what": "  against it: TTFT +ms, 64 new x, short x",
                        **{n: _against(res[n], a) for n, a in again.items()}})
    turns = {n: res[n]["by_turns"] for n in names if "by_turns" in res[n]}
    if turns:
        out.append({"what": "by turns with an engine here: TTFT ms, engine ms", **{
            n: f"{t['ttft_cached']['http_p50'] * 1e3:.1f}, {t['ttft_cached']['engine_p50'] * 1e3:.1f}"
            for n, t in turns.items()}})
        out.append({"what": "  64 new: s, engine s (paired x)", **{
            n: "{:.3f}, {:.3f} ({:.2f}x)".format(*(t["long64"][k] for k in ("http_p50", "engine_p50",
                                                                             "paired_ratio_p50")))
            for n, t in turns.items()}})
    if any("steal_pct" in res[n] for n in names):
        out.append({"what": "CPU time the hypervisor took (steal) %",
                    **{n: f"{res[n]['steal_pct']:.1f}" for n in names if "steal_pct" in res[n]}})
    if any("file_create_us" in res[n] for n in names):
        out.append({"what": "a new 8 KiB file, CPU us (before / after)", **{
            n: "{:.0f} / {:.0f}".format(*res[n]["file_create_us"]) for n in names if "file_create_us" in res[n]}})
    text = table(out, ["what"] + names)
    cpu_rows = []
    for n in names[1:] if eng else names:
        for phase in ("ttft_cached", "short", "streams64"):
            c = res[n][phase]["cpu_ms_per_req"]
            cpu_rows.append({"config": n, "phase": phase, **{k: f"{v:.1f}" for k, v in c.items() if k in KINDS},
                             "total": f"{sum(c.values()):.1f}"})
        for phase, key in (("idle (ms/s)", "idle_cpu_ms_per_s"), ("idle after (ms/s)", "idle_after_cpu_ms_per_s")):
            if key in res[n]:
                idle = res[n][key]
                cpu_rows.append({"config": n, "phase": phase, **{k: f"{v:.0f}" for k, v in idle.items()},
                                 "total": f"{sum(idle.values()):.0f}"})
    if cpu_rows:
        text += ("\n\nCPU ms per request by process kind (idle: CPU ms per second with no load, before the phases "
                 "and after them, L3 then holding their pages)\n")
        text += table(cpu_rows, ["config", "phase", *KINDS, "total"])
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (all rows in a few minutes)")
    ap.add_argument("--configs", default="engine,colocated,1p1d,2p1d")
    ap.add_argument("--label", default=None, help="the JSON key of this run (default: quick or full)")
    ap.add_argument("--http", choices=HTTP_CLIENTS, default="aiohttp",
                    help="the load generator's HTTP client (bench/overhead_client.py); aiohttp as SGLang's and "
                         "vLLM's bench clients")
    ap.add_argument("--keep-homes", action="store_true",
                    help="leave the servers' directories (their L3 pages) at exit and say where: a run started "
                         "right after a removal of thousands of files pays this disk's recently-deleted scan")
    ap.add_argument("--profile", action="store_true", help="py-spy and Ray call counts, colocated short requests")
    ap.add_argument("--profile-seconds", type=float, default=20.0)
    ap.add_argument("--hops", action="store_true", help="round trips hop by hop (colocated), from a Ray driver")
    ap.add_argument("--timeline", action="store_true",
                    help="one request's marks across the ingress and the worker (colocated), and the engine's "
                         "TTFT after pauses (bench/overhead_timeline.py)")
    ap.add_argument("--gc", action="store_true",
                    help="one full GC collection's ms in each server process, its startup heap frozen and not "
                         "(bench/overhead_gc.py; --configs: one config, 1p1d by default)")
    ap.add_argument("--fileio", action="store_true",
                    help="the file L3 store's compiled batch of system calls against Python's, by turns, in this "
                         "process and in a server's workers (bench/overhead_fileio.py; --configs: one config, "
                         "colocated by default)")
    ap.add_argument("--threads", action="store_true",
                    help="CPU per short request by thread, and the workers' steps per request, against the same "
                         "requests in one process; the cached TTFT and the 64-token request by turns with an "
                         "engine in the worker's process (bench/overhead_threads.py; --configs: one config, "
                         "colocated by default)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="--hops: set the server processes' GIL switch interval (s) through the bench's hook")
    ap.add_argument("--profile-rate", type=int, default=100)
    ap.add_argument("--profile-native", action="store_true",
                    help="py-spy with native frames (pauses the targets at each sample); default: only the "
                         "thread holding the GIL, Python frames, --nonblocking")
    args = ap.parse_args(argv)
    if args.keep_homes:
        atexit.unregister(_remove_homes)
        atexit.register(lambda: print("kept the servers' directories: " + " ".join(_HOMES)))
    if args.hops:
        from bench.overhead_hops import run_hops   # each hop's round trip (bench/overhead_hops.py)
        name = args.configs if args.configs in ("colocated", "colocated-l1") else "colocated"
        return run_hops(name, 20 if args.quick else 60, args.switch_interval)
    if args.timeline:
        from bench.overhead_timeline import run_timeline   # one request's marks (bench/overhead_timeline.py)
        name = args.configs if args.configs in ("colocated", "colocated-l1") else "colocated"
        return run_timeline(name, 60 if args.quick else 200)
    if args.gc:
        from bench.overhead_gc import run_gc   # full collections, frozen and not (bench/overhead_gc.py)
        return run_gc(args.configs if args.configs in CONFIGS else "1p1d")
    if args.fileio:
        from bench.overhead_fileio import run_fileio   # compiled against Python L3 writes (overhead_fileio.py)
        return run_fileio(args.configs if args.configs in CONFIGS else "colocated", args.quick)
    if args.threads:
        from bench.overhead_threads import run_threads   # by thread, and steps per request (overhead_threads.py)
        return run_threads(args.configs if args.configs in CONFIGS else "colocated", args.quick)
    if args.profile:
        from bench.overhead_profile import run_profile   # py-spy and Ray call counts (bench/overhead_profile.py)
        name = args.configs if args.configs in CONFIGS else "colocated"
        return run_profile(name, args.profile_seconds, args.profile_rate, args.profile_native)
    reps = REPS["quick" if args.quick else "full"]
    label = args.label or ("quick" if args.quick else "full")
    res: dict = {}
    t0 = time.monotonic()
    for name in args.configs.split(","):
        t, ticks, created = time.monotonic(), machine_ticks(), file_create_us()
        try:
            res[name] = engine_rows(reps) if name == "engine" else http_rows(name, reps, args.http)
            res[name]["steal_pct"] = steal_pct(ticks, machine_ticks())
            res[name]["file_create_us"] = (created, file_create_us())
            if name != "engine" and "engine" in res:
                res[name]["engine_after"] = engine_again(reps)
        except Exception as e:  # noqa: BLE001 - the other configs' rows still count
            print(f"[{name}: failed: {e!r}"[:2000] + "]", file=sys.stderr, flush=True)
            continue
        print(f"[{name}: {time.monotonic() - t:.0f}s]", file=sys.stderr, flush=True)
    print(report(res))
    print(f"\n(all in {time.monotonic() - t0:.0f}s; load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus)")
    path = merge_json("overhead", label, {
        "cpus": os.cpu_count(), "load_avg_after": os.getloadavg(), "reps": reps, "http_client": args.http,
        "engine_settings": ENGINE, "results": res, "table": report(res).splitlines()})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    # The modes' modules (overhead_hops, _gc, _fileio, ...) import bench.overhead: this module, not a second
    # copy with its own server list (--keep-homes would not keep their servers' directories).
    sys.modules.setdefault("bench.overhead", sys.modules[__name__])
    sys.exit(main())
