"""Clients that keep sending /generate requests while a test changes the cluster under them."""
from __future__ import annotations

import threading
import time
from typing import NamedTuple

import httpx


class Result(NamedTuple):
    sent_at: float       # time.monotonic() when the request was sent
    ids: list
    status: int          # 0: no HTTP answer at all
    body: object         # the JSON of a 200, else the text or the error


class Load:
    """``clients`` threads cycling through ``prompts`` (greedy, ``max_new_tokens`` each) until ``stop``."""

    def __init__(self, url: str, prompts: list[list[int]], clients: int = 3, max_new_tokens: int = 6) -> None:
        self.url, self.prompts, self.n = url, prompts, max_new_tokens
        self.results: list[Result] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(clients)]
        for t in self._threads:
            t.start()

    def _client(self, k: int) -> None:
        i = 0
        while not self._stop.is_set():
            ids = self.prompts[(k + i) % len(self.prompts)]
            i += 1
            t = time.monotonic()
            try:
                r = httpx.post(f"{self.url}/generate", timeout=120, json={
                    "input_ids": ids, "sampling_params": {"max_new_tokens": self.n, "temperature": 0}})
                self.results.append(Result(t, ids, r.status_code, r.json() if r.status_code == 200 else r.text))
            except httpx.HTTPError as e:
                self.results.append(Result(t, ids, 0, repr(e)))

    def stop(self) -> list[Result]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=150)
        return self.results


def routes(results) -> set:
    """The workers that served any of ``results``."""
    out = set()
    for r in results:
        if r.status == 200:
            route = r.body["meta_info"]["route"]
            out |= {route["prefill"], route.get("decode")} - {None}   # no decode: prefilled on its decode worker
    return out
