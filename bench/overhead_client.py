"""The out-of-process load generator of bench/overhead.py: its CPU is its own process's, apart from the
server's. It reads one JSON command a line on stdin, runs it against ``--url`` and answers one JSON line
on stdout (``{"ok": ..., "cpu_s": ..., ...}``), so the caller can read every server process's CPU
times right before and after each phase.

    python -m bench.overhead_client --url http://127.0.0.1:8000 [--http aiohttp|httpx]

``--http``: the HTTP client library. aiohttp by default: it is what SGLang's ``bench_serving`` and vLLM's
``benchmark_serving`` send with. httpx costs ~1 ms more of the client's CPU and ~1 ms more latency per
request on this machine. Both share the cores with the server, so a heavier client also makes the server's
rows worse.

Commands (``op``):
  ``models``   {"n"}: sequential GET /v1/models; latencies.
  ``requests`` {"prompts", "max_new", "concurrency"}: non-streamed /generate (input_ids, greedy,
               ignore_eos), at most ``concurrency`` in flight (closed loop); latencies and wall time.
  ``streams``  {"prompts", "max_new"}: every prompt streamed at once; each request's TTFT (first chunk
               carrying an output token) and latency.
  ``stream_seq`` {"prompts", "max_new"}: the prompts streamed one after another; each one's TTFT.
  ``slow``     {"prompts", "max_new", "slow_prompt", "slow_max_new", "slow_delay"}: ``streams`` of
               ``prompts`` beside one more stream (when ``slow_prompt`` is set) whose reader reads
               nothing for ``slow_delay`` seconds, then everything (its own socket, a 4 KB receive
               buffer: the server's writes block as they would to a slow client on a real network); the
               others' latencies and whether the slow one got all its tokens.
  ``quit``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from urllib.parse import urlsplit

import aiohttp
import httpx

HTTP_CLIENTS = ("aiohttp", "httpx")


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _body(ids: list[int], max_new: int, stream: bool) -> dict:
    return {"input_ids": ids, "stream": stream,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}}


def _event(line: str) -> int | None:
    """One line of a /generate stream -> the output ids it carries so far (None: not an event)."""
    if not line.startswith("data:") or line.strip() == "data: [DONE]":
        return None
    ev = json.loads(line[5:])
    if "error" in ev:
        raise RuntimeError(ev["error"].get("message", str(ev["error"])))
    return len(ev.get("output_ids") or ())


class Client:
    def __init__(self, url: str, conns: int = 96, http: str = "aiohttp") -> None:
        if http not in HTTP_CLIENTS:
            raise ValueError(f"http: one of {HTTP_CLIENTS}, got {http!r}")
        self.url = url.rstrip("/")
        self.kind = http
        self.conns = conns
        self._session: aiohttp.ClientSession | None = None   # made on the running loop, at first use
        limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
        self.http = httpx.AsyncClient(timeout=300, limits=limits)

    def _aio(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.conns),
                                                  timeout=aiohttp.ClientTimeout(total=300))
        return self._session

    async def aclose(self) -> None:
        await self.http.aclose()
        if self._session is not None:
            await self._session.close()

    async def one(self, ids: list[int], max_new: int) -> tuple[float, int]:
        url, body = f"{self.url}/generate", _body(ids, max_new, False)
        t = time.perf_counter()
        if self.kind == "aiohttp":
            async with self._aio().post(url, json=body) as r:
                status, data = r.status, await r.read()
        else:
            r = await self.http.post(url, json=body)
            status, data = r.status_code, r.content
        dt = time.perf_counter() - t
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {data[:200]!r}")
        return dt, len(json.loads(data)["output_ids"])

    async def get(self, path: str) -> None:
        if self.kind == "aiohttp":
            async with self._aio().get(f"{self.url}{path}") as r:
                await r.read()
                r.raise_for_status()
        else:
            (await self.http.get(f"{self.url}{path}")).raise_for_status()

    async def stream(self, ids: list[int], max_new: int, delay: float = 0.0) -> dict:
        """One streamed request: TTFT, latency, tokens. ``delay``: read nothing for that long first."""
        url, body = f"{self.url}/generate", _body(ids, max_new, True)
        t = time.perf_counter()
        ttft, n = None, 0

        def seen(k: int | None) -> None:
            nonlocal ttft, n
            if k and ttft is None:
                ttft = time.perf_counter() - t
            n = max(n, k or 0)
        if self.kind == "aiohttp":
            async with self._aio().post(url, json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
                if delay:
                    await asyncio.sleep(delay)
                async for line in resp.content:   # one line at a time, as SGLang's bench_serving reads
                    seen(_event(line.decode().rstrip("\r\n")))
        else:
            async with self.http.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                if delay:
                    await asyncio.sleep(delay)
                async for line in resp.aiter_lines():
                    seen(_event(line))
        return {"ttft": ttft, "latency": time.perf_counter() - t, "tokens": n}

    async def raw_stream(self, ids: list[int], max_new: int, delay: float, rcvbuf: int = 4096) -> dict:
        """One streamed request on its own socket with a small receive buffer (and asyncio's buffer kept
        small too), so that a reader that waits makes the server's writes block within a few KB, as a
        slow client on a real network would; reads nothing for ``delay`` s, then everything."""
        u = urlsplit(self.url)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        t = time.perf_counter()
        await asyncio.get_running_loop().sock_connect(sock, (u.hostname, u.port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
        body = json.dumps(_body(ids, max_new, True)).encode()
        writer.write(b"POST /generate HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n" % (u.netloc.encode(), len(body)) + body)
        await writer.drain()
        await asyncio.sleep(delay)
        data = bytearray()
        while chunk := await reader.read(1 << 16):
            data += chunk
        writer.close()
        head, _, rest = bytes(data).partition(b"\r\n\r\n")
        if b"chunked" in head.lower():
            out, i = bytearray(), 0
            while i < len(rest):
                j = rest.index(b"\r\n", i)
                size = int(rest[i:j].split(b";")[0], 16)
                if size == 0:
                    break
                out += rest[j + 2:j + 2 + size]
                i = j + 2 + size + 2
            rest = bytes(out)
        n = 0
        for line in rest.decode(errors="replace").splitlines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                n = max(n, len(json.loads(line[5:]).get("output_ids") or ()))
        return {"ttft": None, "latency": time.perf_counter() - t, "tokens": n,
                "status": head.split(b"\r\n", 1)[0].decode(errors="replace"), "bytes": len(data)}

    async def run(self, cmd: dict) -> dict:
        op = cmd["op"]
        if op == "models":
            lat = []
            for _ in range(cmd["n"]):
                t = time.perf_counter()
                await self.get("/v1/models")
                lat.append(time.perf_counter() - t)
            return {"latency": lat}
        if op == "requests":
            sem = asyncio.Semaphore(cmd.get("concurrency", 1))

            async def go(ids):
                async with sem:
                    return await self.one(ids, cmd["max_new"])
            t = time.perf_counter()
            res = await asyncio.gather(*(go(p) for p in cmd["prompts"]))
            wall = time.perf_counter() - t
            bad = sum(n != cmd["max_new"] for _, n in res)
            return {"latency": [d for d, _ in res], "wall": wall, "wrong_length": bad}
        if op == "stream_seq":   # one streamed request after another: each one's TTFT alone
            res = [await self.stream(p, cmd["max_new"]) for p in cmd["prompts"]]
            return {"ttft": [r["ttft"] for r in res], "latency": [r["latency"] for r in res],
                    "wrong_length": sum(r["tokens"] != cmd["max_new"] for r in res)}
        if op in ("streams", "slow"):
            tasks = [self.stream(p, cmd["max_new"]) for p in cmd["prompts"]]
            slow = None
            if cmd.get("slow_prompt"):
                slow = asyncio.ensure_future(self.raw_stream(cmd["slow_prompt"], cmd["slow_max_new"], cmd["slow_delay"]))
                await asyncio.sleep(0.05)   # the slow stream is running (and its buffers filling) first
            t = time.perf_counter()
            res = await asyncio.gather(*tasks)
            wall = time.perf_counter() - t
            out = {"ttft": [r["ttft"] for r in res], "latency": [r["latency"] for r in res], "wall": wall,
                   "wrong_length": sum(r["tokens"] != cmd["max_new"] for r in res)}
            if slow is not None:
                s = await slow
                out["slow"] = {**s, "complete": s["tokens"] == cmd["slow_max_new"]}
            return out
        raise ValueError(f"unknown op {op!r}")


async def serve_stdin(url: str, http: str = "aiohttp") -> None:
    client = Client(url, http=http)
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line or not line.strip():
                if not line:
                    return
                continue
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                return
            c0 = _cpu()
            try:
                out = {"ok": True, **await client.run(cmd)}
            except Exception as e:  # noqa: BLE001 - reported to the caller
                out = {"ok": False, "error": repr(e)[:500]}
            out["cpu_s"] = _cpu() - c0
            sys.stdout.write(json.dumps(out) + "\n")
            sys.stdout.flush()
    finally:
        await client.aclose()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.overhead_client")
    ap.add_argument("--url", required=True)
    ap.add_argument("--http", choices=HTTP_CLIENTS, default="aiohttp")
    args = ap.parse_args(argv)
    asyncio.run(serve_stdin(args.url, args.http))
    return 0


if __name__ == "__main__":
    sys.exit(main())
