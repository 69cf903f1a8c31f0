"""The multi-turn serving benchmark over HTTP (the workload: bench/multiturn_workload.py). Runs against
any server speaking SGLang's /generate or OpenAI's /v1/chat/completions, streamed:

    python -m bench.multiturn --url http://127.0.0.1:8000 --num-clients 16 --num-rounds 4 \\
        --request-length 512 --sub-question-length 64 --output-length 32 --max-parallel 4 \\
        [--request-rate 8] [--round-barrier] [--api chat] [--jsonl out.jsonl]

Prints TTFT (mean, p50, p90, p99), inter-token latency, input/output tokens per second and the cache
hit rate overall and per round; writes one JSON line per request with ``--jsonl``. TTFT is measured at
the client: from sending the request to the first streamed chunk that carries output.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

from bench.multiturn_workload import (Conversation, RequestRecord, TurnQueue, WorkloadConfig, arrival_gaps,
                                      format_summary, make_conversations, summarize)


def _events(line: str) -> Optional[dict]:
    """One SSE line -> its JSON payload (None for blank lines, comments and the [DONE] marker)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    return json.loads(data)


async def _send_generate(http: httpx.AsyncClient, url: str, conv: Conversation, cfg: WorkloadConfig,
                         rec: RequestRecord, t0: float) -> str:
    # SGLang's benchmark/hicache/bench_multiturn.py native payload, field for field.
    body = {"text": conv.prompt(), "stream": True, "stream_options": {"include_usage": True},
            "sampling_params": {"max_new_tokens": cfg.output_length, "temperature": 0.0, "ignore_eos": True},
            "lora_path": "", "return_logprob": False, "logprob_start_len": -1}
    text, last_t, last_n, first_cached = "", None, 0, None
    async with http.stream("POST", f"{url}/generate", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            ev = _events(line)
            if ev is None:
                continue
            if "error" in ev:
                raise RuntimeError(ev["error"].get("message", str(ev["error"])))
            now = time.perf_counter() - t0
            n = len(ev.get("output_ids") or ()) or ev.get("meta_info", {}).get("completion_tokens", 0)
            if n > last_n:
                if rec.ttft is None:
                    rec.ttft = now - rec.start
                elif last_t is not None:
                    rec.itl.append((now - last_t) / (n - last_n))
                last_t, last_n = now, n
            text = ev.get("text", text)            # cumulative in SGLang's stream format
            meta = ev.get("meta_info") or {}
            rec.prompt_tokens = meta.get("prompt_tokens", rec.prompt_tokens)
            if first_cached is None and "cached_tokens" in meta:   # SGLang's tooling reads the first chunk
                first_cached = rec.cached_tokens = meta["cached_tokens"]
            rec.output_tokens = meta.get("completion_tokens", last_n)
    return text


async def _send_chat(http: httpx.AsyncClient, url: str, conv: Conversation, cfg: WorkloadConfig,
                     rec: RequestRecord, t0: float, model: str = "") -> str:
    # The OpenAI client's request (as SGLang's bench_multiturn OpenAI mode and `vllm bench serve
    # --backend openai-chat` send it): the served model's name, usage in the last chunk.
    body = {"model": model, "messages": conv.messages(), "stream": True, "max_completion_tokens": cfg.output_length,
            "temperature": 0.0, "stream_options": {"include_usage": True}, "ignore_eos": True}
    parts: list[str] = []
    last_t = None
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            ev = _events(line)
            if ev is None:
                continue
            if "error" in ev:
                raise RuntimeError(ev["error"].get("message", str(ev["error"])))
            now = time.perf_counter() - t0
            for ch in ev.get("choices") or ():
                delta = (ch.get("delta") or {}).get("content") or ""
                if delta or ch.get("finish_reason") is None:
                    # A chunk is one engine step: the first is the first token, even if its bytes
                    # are held back (an incomplete UTF-8 sequence).
                    if rec.ttft is None:
                        rec.ttft = now - rec.start
                    elif last_t is not None:
                        rec.itl.append(now - last_t)
                    last_t = now
                parts.append(delta)
            usage = ev.get("usage")
            if usage:
                rec.prompt_tokens = usage.get("prompt_tokens", 0)
                rec.output_tokens = usage.get("completion_tokens", 0)
                rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
    return "".join(parts)


def parse_metrics(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text exposition -> {name: [(labels, value), ...]} (comments skipped)."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels = {}
        for part in rest.rstrip("}").split('",'):
            k, eq, v = part.partition('="')
            if eq:
                labels[k.strip(", ")] = v.rstrip('"')
        try:
            out.setdefault(name, []).append((labels, float(value)))
        except ValueError:
            continue
    return out


def metric_sum(parsed: dict, name: str, **match) -> float:
    return sum(v for labels, v in parsed.get(name, ()) if all(labels.get(k) == x for k, x in match.items()))


async def _scrape(http: httpx.AsyncClient, url: str) -> dict:
    """The server's /metrics, parsed; empty when it has none (any server may be benchmarked)."""
    try:
        r = await http.get(f"{url}/metrics", timeout=10)
        return parse_metrics(r.text) if r.status_code == 200 else {}
    except httpx.HTTPError:
        return {}


def server_side(before: dict, after: dict, num_clients: int) -> dict:
    """Host KV memory per conversation and bytes moved between tiers during the run, from strata's
    /metrics (``strata_host_kv_bytes``, ``strata_kv_moved_bytes``); empty for other servers."""
    if "strata_host_kv_bytes" not in after:
        return {}
    moved = {}
    for labels, _ in after.get("strata_kv_moved_bytes", ()):
        d = labels.get("direction")
        if d and d not in moved:
            moved[d] = metric_sum(after, "strata_kv_moved_bytes", direction=d) - \
                metric_sum(before, "strata_kv_moved_bytes", direction=d)
    return {"host_kv_bytes_per_conversation": metric_sum(after, "strata_host_kv_bytes") / num_clients,
            "kv_moved_bytes": moved}


class Progress:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, total: int, enabled: bool, label: str = "") -> None:
        self.total, self.n, self.enabled, self.label = total, 0, enabled, label
        self.t0 = time.perf_counter()

    def update(self, failed: int = 0) -> None:
        self.n += 1
        if not self.enabled:
            return
        width = 30
        fill = int(width * self.n / max(1, self.total))
        el = time.perf_counter() - self.t0
        sys.stderr.write(f"\r{self.label}[{'#' * fill}{'.' * (width - fill)}] {self.n}/{self.total} "
                         f"{el:5.1f}s" + (f" {failed} failed" if failed else ""))
        if self.n >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


async def run_workload(url: str, cfg: WorkloadConfig, progress: bool = True, label: str = "",
                       timeout: float = 300.0, server: Optional[dict] = None) -> tuple[list[RequestRecord], float]:
    """Run every conversation to its last round against ``url``; returns (records, seconds).
    ``server``: filled with what the server's /metrics says about its cache (``server_side``)."""
    url = url.rstrip("/")
    convs = make_conversations(cfg)
    queue = TurnQueue(cfg.num_clients, cfg.num_rounds, cfg.round_barrier)
    gaps = iter(arrival_gaps(cfg.request_rate, cfg.num_requests, cfg.seed))
    sem = asyncio.Semaphore(cfg.max_parallel)
    bar = Progress(cfg.num_requests, progress, label)
    records: list[RequestRecord] = []
    send = _send_generate if cfg.api == "generate" else _send_chat
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=cfg.max_parallel + 4, max_keepalive_connections=cfg.max_parallel + 4)

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        before = await _scrape(http, url) if server is not None else {}
        if cfg.api != "generate":   # as vLLM's and SGLang's clients do without --model: the served one
            model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
            send = functools.partial(_send_chat, model=model)

        async def one(cid: int, rnd: int) -> None:
            rec = RequestRecord(client=cid, round=rnd + 1, start=time.perf_counter() - t0)
            try:
                text = await send(http, url, convs[cid], cfg, rec, t0)
                rec.latency = time.perf_counter() - t0 - rec.start
                if rec.ttft is None:
                    raise RuntimeError("the stream carried no output")
            except Exception as e:  # a failed request is recorded; its conversation goes on without it
                rec.error = repr(e)[:300]
                text = ""
            convs[cid].answer(text)
            records.append(rec)
            queue.finish(cid)
            sem.release()
            bar.update(sum(r.error is not None for r in records))

        pending: set[asyncio.Task] = set()
        while not queue.finished:
            item = queue.pop()
            if item is None:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()
                continue
            gap = next(gaps)
            if gap:
                await asyncio.sleep(gap)
            await sem.acquire()
            pending.add(asyncio.create_task(one(*item)))
        for t in pending:
            await t
        elapsed = time.perf_counter() - t0
        if server is not None:
            await asyncio.sleep(0.5)  # workers report their counters every 50 ms
            server.update(server_side(before, await _scrape(http, url), cfg.num_clients))
        return sorted(records, key=lambda r: (r.round, r.client)), elapsed


def write_jsonl(path: str | Path, records: list[RequestRecord]) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(dataclasses.asdict(r)) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.multiturn", description=__doc__.splitlines()[0])
    d = WorkloadConfig()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api", choices=("generate", "chat"), default=d.api)
    ap.add_argument("--num-clients", type=int, default=d.num_clients)
    ap.add_argument("--num-rounds", type=int, default=d.num_rounds)
    ap.add_argument("--request-length", type=int, default=d.request_length)
    ap.add_argument("--sub-question-length", type=int, default=d.sub_question_length)
    ap.add_argument("--output-length", type=int, default=d.output_length)
    ap.add_argument("--request-rate", type=float, default=d.request_rate, help="Poisson requests/s (default inf)")
    ap.add_argument("--max-parallel", type=int, default=d.max_parallel)
    ap.add_argument("--round-barrier", action="store_true")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--jsonl", default=None, help="write one JSON line per request here")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    try:
        cfg = WorkloadConfig(args.num_clients, args.num_rounds, args.request_length, args.sub_question_length,
                             args.output_length, args.request_rate, args.max_parallel, args.round_barrier,
                             args.seed, args.api)
    except ValueError as e:
        print(f"bench.multiturn: {e}", file=sys.stderr)
        return 2
    server: dict = {}
    records, dur = asyncio.run(run_workload(args.url, cfg, progress=not args.no_progress, server=server))
    s = summarize(records, dur)
    print(format_summary(s))
    if server:
        moved = "  ".join(f"{d} {n / 2**20:.2f} MB" for d, n in server["kv_moved_bytes"].items())
        print(f"server cache    host KV {server['host_kv_bytes_per_conversation'] / 1024:,.0f} KB per conversation"
              f"  moved: {moved}")
    if args.jsonl:
        write_jsonl(args.jsonl, records)
        print(f"wrote {args.jsonl}")
    return 0 if s["errors"] == 0 and not math.isnan(s["hit_rate"]) else 1


if __name__ == "__main__":
    sys.exit(main())
