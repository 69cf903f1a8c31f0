"""The PD cluster over HTTP with the KV moving prefill -> decode through real NIXL agents (UCX): greedy
outputs equal Engine.generate; a stalled transfer and a decode worker killed mid-transfer give the client
a clean 503 and leave every pool entirely free; the restarted decode worker serves the next request.
(The default ray_object backend runs through the same flow in tests/e2e; each backend is also tested
actor to actor in tests/actors/test_transfer.py.)"""
from __future__ import annotations

import dataclasses
import json
import threading
import time

import httpx
import pytest

from cluster import launch  # sets the Ray environment (loopback, no token auth) on import
from cluster.config import load_config
from engine import Engine, SamplingParams
from tests.util import free_port
from tests import numerics

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster(ray_session):
    try:
        from storage.l3.nixl import _load_nixl
        _load_nixl()
    except RuntimeError as e:
        pytest.skip(f"NIXL cannot load: {e}")
    cfg = load_config("cluster/configs/pd-1p1d-nixl.yaml")
    # Every request over the transfer: none prefilled on the decode worker that holds its prompt (the same
    # prompt is sent streamed too; conditional disaggregation: tests/e2e/test_cluster_http.py).
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, poison_kv=True),
                              server=dataclasses.replace(cfg.server, port=free_port(), request_timeout=60.0),
                              router=dataclasses.replace(cfg.router, local_prefill_tokens=0))
    handles = launch.deploy(cfg)
    yield handles
    launch.shutdown(handles)


@pytest.fixture(scope="module")
def reference(cluster):
    return Engine.from_pretrained(cluster["model_path"], page_size=16, num_pages=512)


def _post(url, ids, n=8, stream=False, timeout=90):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}, "stream": stream}
    return httpx.post(f"{url}/generate", json=body, timeout=timeout)


def _assert_all_free(cluster):
    url, workers = cluster["url"], cluster["workers"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:   # an in-flight cancel/decode may still be landing
        if httpx.post(f"{url}/flush_cache", timeout=30).status_code == 200:
            stats = ray.get([w.stats.remote() for w in workers.values()], timeout=60)
            tstats = ray.get([w.transfer_stats.remote() for w in workers.values()], timeout=60)
            if all(p["used"] == 0 for s in stats for p in s["pool"].values()) \
                    and all(t.leases.live == 0 for t in tstats):
                assert all(t.sends.staging_pages_used == 0 for t in tstats)
                return
        time.sleep(0.5)
    raise AssertionError(f"pools not free: {stats} {tstats}")


@pytest.mark.numerics
def test_greedy_outputs_over_nixl_equal_engine_generate(cluster, reference):
    url = cluster["url"]
    for ids in ([5, 6, 7], list(range(90)), [i % 256 for i in range(3, 300)]):
        want = reference.generate([ids], SamplingParams(max_new_tokens=8, return_logits=True))[0]
        r = _post(url, ids).json()
        numerics.assert_same_output(r["output_ids"], want, reference.model_config, str(r))
        assert r["meta_info"]["route"]["decode"] == "decode-0"
        with httpx.stream("POST", f"{url}/generate", json={"input_ids": ids, "stream": True, "sampling_params":
                                                           {"max_new_tokens": 8, "temperature": 0}}, timeout=90) as resp:
            chunks = [json.loads(ln[6:]) for ln in resp.iter_lines() if ln.startswith("data: {")]
        numerics.assert_same_output(chunks[-1]["output_ids"], want, reference.model_config, "stream")
    ts = ray.get(cluster["workers"]["prefill-0"].transfer_stats.remote()).sends
    assert ts.sends >= 6 and ts.failed == 0
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert 'strata_transfer_bytes_total{worker="prefill-0",backend="nixl"}' in metrics
    _assert_all_free(cluster)


@pytest.mark.numerics
def test_concurrent_requests_each_get_their_own_pages(cluster, reference):
    from concurrent.futures import ThreadPoolExecutor
    url = cluster["url"]
    prompts = [[(i * k + 3) % 256 for i in range(40 + 37 * k)] for k in range(6)]
    want = reference.generate(prompts, SamplingParams(max_new_tokens=8, return_logits=True))
    with ThreadPoolExecutor(6) as ex:
        got = list(ex.map(lambda ids: _post(url, ids).json()["output_ids"], prompts))
    numerics.assert_same_outputs(got, want, reference.model_config, "concurrent")
    _assert_all_free(cluster)


def test_a_stalled_transfer_fails_the_request_cleanly(cluster):
    url, pre = cluster["url"], cluster["workers"]["prefill-0"]
    ray.get(pre.set_transfer_options.remote(transfer_timeout=1.0, debug_send_delay=1.5))
    try:
        r = _post(url, list(range(120)))
        assert r.status_code == 503 and "kv transfer failed" in r.text, r.text
        with httpx.stream("POST", f"{url}/generate", json={"input_ids": list(range(120)), "stream": True},
                          timeout=90) as resp:
            resp.read()
            assert resp.status_code == 503
    finally:
        ray.get(pre.set_transfer_options.remote(transfer_timeout=20.0, debug_send_delay=0.0))
    _assert_all_free(cluster)
    assert _post(url, [1, 2, 3]).status_code == 200


@pytest.mark.numerics
def test_killing_the_decode_worker_mid_transfer_frees_everything_and_it_comes_back(cluster, reference):
    url, pre, dec = cluster["url"], cluster["workers"]["prefill-0"], cluster["workers"]["decode-0"]
    ray.get(pre.set_transfer_options.remote(debug_send_delay=2.0))
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("r", _post(url, list(range(200)))))
    th.start()
    try:
        time.sleep(1.0)                 # the decode side has leased its pages; the send waits
        ray.kill(dec, no_restart=False)
        th.join(120)
    finally:
        ray.get(pre.set_transfer_options.remote(debug_send_delay=0.0))
    r = out["r"]
    assert r.status_code == 503 and ("kv transfer failed" in r.text or "request failed" in r.text), r.text
    # the prefill side let go of its staging pages at once (well within the lease)
    assert ray.get(pre.transfer_stats.remote()).sends.staging_pages_used == 0
    # the restarted decode worker (a new NIXL agent) serves the next request with the right tokens
    ids = [i % 200 for i in range(150)]
    want = reference.generate([ids], SamplingParams(max_new_tokens=8, return_logits=True))[0]
    deadline = time.monotonic() + 120
    while True:
        r = _post(url, ids)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert r.status_code == 200, r.text
    numerics.assert_same_output(r.json()["output_ids"], want, reference.model_config, "after the kill")
    _assert_all_free(cluster)


@pytest.mark.numerics
def test_killing_the_prefill_worker_mid_transfer_releases_the_decode_lease_at_once(cluster, reference):
    url, pre, dec = cluster["url"], cluster["workers"]["prefill-0"], cluster["workers"]["decode-0"]
    ray.get(pre.set_transfer_options.remote(debug_send_delay=3.0))
    ids = [(i * 7) % 250 for i in range(180)]
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("r", _post(url, ids)))
    th.start()
    deadline = time.monotonic() + 60
    while ray.get(dec.transfer_stats.remote()).leases.live == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.get(dec.transfer_stats.remote()).leases.live == 1
    ray.kill(pre, no_restart=False)      # the restarted worker comes back without the test delay
    t0 = time.monotonic()
    while ray.get(dec.transfer_stats.remote()).leases.live and time.monotonic() - t0 < 30:
        time.sleep(0.1)
    freed_after = time.monotonic() - t0
    th.join(180)
    st = ray.get(dec.transfer_stats.remote()).leases
    assert st.cancelled >= 1 and freed_after < 10, (st, freed_after)   # cancelled by the ingress, not expired
    # a non-streamed request is retried once on the restarted worker: the client still gets its tokens
    want = reference.generate([ids], SamplingParams(max_new_tokens=8, return_logits=True))[0]
    assert out["r"].status_code == 200, out["r"].text
    numerics.assert_same_output(out["r"].json()["output_ids"], want, reference.model_config, "after the kill")
    _assert_all_free(cluster)
