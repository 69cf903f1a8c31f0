"""POST /flush_cache on the real cluster (2 prefill + 1 decode workers, file L3): every tier flushed, L3
included, and the router's index with it; or, with a worker busy, nothing flushed at all."""
import random

import httpx
import ray

from actors.routing import prompt_blocks, prompt_keys
from engine.model.tokenizer import TextTokenizer


def _prompt(seed: int, n: int = 700) -> str:
    rnd = random.Random(seed)
    return "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))


def _generate(url: str, text: str, max_new: int = 2) -> dict:
    r = httpx.post(f"{url}/generate", json={"text": text, "sampling_params": {"max_new_tokens": max_new,
                                                                             "temperature": 0}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def _predicted(cluster, text: str) -> int:
    """Pages of ``text`` the router would serve from cache (any worker, any tier)."""
    router = cluster["router"]
    ids = TextTokenizer(cluster["model_path"]).encode(text)
    cfg, geom = ray.get(router.config.remote()), ray.get(router.geometry.remote())
    return ray.get(router.route.remote(prompt_blocks(ids, geom, cfg), len(ids))).cached_pages


def _wait_l3(cluster, text: str, timeout: float = 30.0) -> None:
    """Until the prompt's pages are in L3 (write-through runs in the background)."""
    import time
    deadline = time.monotonic() + timeout
    router = cluster["router"]
    ids = TextTokenizer(cluster["model_path"]).encode(text)
    cfg, geom = ray.get(router.config.remote()), ray.get(router.geometry.remote())
    last = prompt_keys(ids, geom, cfg)[-1].hex()
    storage = ray.get_actor("strata-storage")   # what its L3 stream says the store holds
    while not any(k.endswith(f"/full/{last}") for k, _name in ray.get(storage.l3_entries.remote())):
        assert time.monotonic() < deadline, "the prompt never reached L3"
        time.sleep(0.2)


def _flush(url: str) -> httpx.Response:
    import time
    deadline = time.monotonic() + 60
    while (r := httpx.post(f"{url}/flush_cache", timeout=60)).status_code == 409 and time.monotonic() < deadline:
        time.sleep(0.5)     # an earlier test's request may still be finishing
    return r


def test_flush_empties_every_tier_l3_included_and_the_router_predicts_nothing(cluster):
    """The issue's repro: a 700-token prompt, flushed, sent again got cached_tokens 688 from L3."""
    url, text = cluster["url"], _prompt(1)
    _generate(url, text)
    _wait_l3(cluster, text)
    assert _generate(url, text)["cached_tokens"] > 0
    r = _flush(url)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["flushed"] is True and set(body["workers"]) == {"prefill-0", "prefill-1", "decode-0"}, body
    assert body["L3_store"]["backend"] == "file" and body["L3_store"]["objects_removed"] > 0, body
    assert body["router"]["confirmed"] is True, body
    assert sum(w["L1"]["full"] for w in body["workers"].values()) > 0, body
    assert _predicted(cluster, text) == 0
    meta = _generate(url, text)
    assert meta["cached_tokens"] == 0, meta
    assert meta["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 0, "storage_backend": "file"}


def test_a_busy_worker_makes_the_flush_flush_nothing(cluster):
    """A request streaming on the decode worker: 409 naming it, and the idle prefill workers keep their
    cache (before, they were flushed while the busy one answered 409)."""
    url, text = cluster["url"], _prompt(2, 400)
    _generate(url, text)
    with httpx.stream("POST", f"{url}/generate", timeout=120,
                      json={"text": _prompt(3, 100), "stream": True,
                            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}) as long:
        lines = long.iter_lines()
        next(line for line in lines if line.startswith("data:"))    # it runs
        r = httpx.post(f"{url}/flush_cache", timeout=60)
        assert r.status_code == 409, r.text
        body = r.json()
        assert body["flushed"] is False and "decode-0" in body["busy"], body
        for _ in lines:
            pass
    assert _predicted(cluster, text) > 0
    assert _generate(url, text)["cached_tokens"] > 0
