"""End to end over HTTP against a real local Ray cluster (2 prefill + 1 decode workers)."""
import json
import time

import httpx
import openai
import pytest
import ray

from engine import Engine, SamplingParams
from tests import numerics


@pytest.fixture(scope="module")
def reference(cluster):
    return Engine.from_pretrained(cluster["model_path"], page_size=16, num_pages=512)


def _ref(eng, ids, n):
    """The reference answer, with the logits the numerics policy's near-tie rule reads."""
    return eng.generate([ids], SamplingParams(max_new_tokens=n, return_logits=True))[0]


def _sse(resp) -> list:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


@pytest.mark.numerics
def test_generate_and_openai_match_engine_generate(cluster, reference):
    url = cluster["url"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60)
    prompts = [[5, 6, 7], list(range(90)), [i % 256 for i in range(3, 300)]]
    for ids in prompts:
        want = _ref(reference, ids, 12)
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
        r = httpx.post(f"{url}/generate", json=body, timeout=60).json()
        mc = reference.model_config
        numerics.assert_same_output(r["output_ids"], want, mc, "/generate")
        assert r["meta_info"]["prompt_tokens"] == len(ids) and r["meta_info"]["finish_reason"]["type"] in ("length", "stop")
        with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=60) as resp:
            chunks = _sse(resp)
        numerics.assert_same_output(chunks[-1]["output_ids"], want, mc, "/generate stream")
        assert chunks[-1]["meta_info"]["completion_tokens"] == len(chunks[-1]["output_ids"])
        c = client.completions.create(model="strata-tiny", prompt=ids, max_tokens=12, temperature=0)
        numerics.assert_same_text(c.choices[0].text, want, reference.tokenizer, mc, "completions")
        assert c.usage.prompt_tokens == len(ids)
        s = client.completions.create(model="strata-tiny", prompt=ids, max_tokens=12, temperature=0, stream=True)
        numerics.assert_same_text("".join(ch.choices[0].text for ch in s if ch.choices), want,
                                  reference.tokenizer, mc, "completions stream")
    chat_ids = reference.tokenizer.encode("<|start|>user<|message|>hi<|end|><|start|>assistant<|message|>")
    want = _ref(reference, chat_ids, 6)
    cc = client.chat.completions.create(model="strata-tiny", messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=6, temperature=0)
    numerics.assert_same_text(cc.choices[0].message.content, want, reference.tokenizer, reference.model_config, "chat")
    stream = client.chat.completions.create(model="strata-tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    parts = list(stream)
    numerics.assert_same_text("".join(p.choices[0].delta.content or "" for p in parts if p.choices), want,
                              reference.tokenizer, reference.model_config, "chat stream")
    assert parts[-1].usage.completion_tokens == 6


def test_second_turn_goes_back_to_the_prefill_worker_holding_the_first(cluster):
    url = cluster["url"]
    hist = [i % 251 for i in range(7, 400)]
    r1 = httpx.post(f"{url}/generate", json={"input_ids": hist, "sampling_params": {"max_new_tokens": 8,
                                                                                    "temperature": 0}}, timeout=60).json()
    p1 = r1["meta_info"]["route"]["prefill"]
    time.sleep(0.5)  # KV events reach the router within a report interval
    # 200 new tokens: more than the decode worker, which holds the first turn too, prefills itself
    # (router.local_prefill_tokens: test_a_short_next_turn_is_prefilled_on_the_decode_worker_...)
    turn2 = hist + r1["output_ids"] + [3] * 200
    r2 = httpx.post(f"{url}/generate", json={"input_ids": turn2, "sampling_params": {"max_new_tokens": 8,
                                                                                     "temperature": 0}}, timeout=60).json()
    assert r2["meta_info"]["route"]["prefill"] == p1
    assert r2["meta_info"]["cached_tokens"] >= 16 * (len(hist) // 16) - 16


def test_once_the_first_prefill_worker_is_gone_the_other_serves_turn_two_from_l3(cluster):
    url, router = cluster["url"], cluster["router"]
    hist = [(i * 13) % 251 for i in range(500)]
    r1 = httpx.post(f"{url}/generate", json={"input_ids": hist, "sampling_params": {"max_new_tokens": 8,
                                                                                    "temperature": 0}}, timeout=60).json()
    p1 = r1["meta_info"]["route"]["prefill"]
    time.sleep(1.0)  # write-through L2 -> L3 runs in the background; events reach the router
    ray.get(router.remove_worker.remote(p1))
    try:
        turn2 = hist + r1["output_ids"] + [3] * 200   # more than the decode worker prefills itself
        r2 = httpx.post(f"{url}/generate", json={"input_ids": turn2, "sampling_params": {
            "max_new_tokens": 8, "temperature": 0}}, timeout=60).json()
        assert r2["meta_info"]["route"]["prefill"] != p1
        assert r2["meta_info"]["cached_tokens_by_tier"]["L3"] > 0
        assert r2["meta_info"]["cached_tokens"] >= 16 * (len(hist) // 16) - 32
    finally:
        ray.get(router.restore_worker.remote(p1))


@pytest.mark.numerics
def test_a_short_next_turn_is_prefilled_on_the_decode_worker_holding_the_conversation(cluster, reference):
    """Conditional disaggregation: the decode worker that ran turn one holds it (it inserts what it decoded
    in its tree); turn two adds 20 tokens, fewer than ``router.local_prefill_tokens``, so that worker
    prefills them itself: no prefill worker, no lease, no transfer, and the same tokens."""
    url, router = cluster["url"], cluster["router"]
    hist = [(i * 7 + 3) % 251 for i in range(300)]

    def post(ids):
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        return httpx.post(f"{url}/generate", json=body, timeout=60).json()
    r1 = post(hist)
    d1 = r1["meta_info"]["route"]["decode"]
    assert d1 is not None   # new to every worker: handed off
    time.sleep(0.5)         # the decode worker's KV events reach the router within a report interval
    before = ray.get(router.status.remote(), timeout=30)["local_prefills"]
    turn2 = hist + r1["output_ids"] + [9] * 20
    r2 = post(turn2)
    assert r2["meta_info"]["route"]["prefill"] == d1 and r2["meta_info"]["route"].get("decode") is None
    assert r2["meta_info"]["cached_tokens"] >= 16 * (len(hist) // 16)
    numerics.assert_same_output(r2["output_ids"], _ref(reference, turn2, 8), reference.model_config, "local prefill")
    assert ray.get(router.status.remote(), timeout=30)["local_prefills"] == before + 1
    # a request with no decode phase stays on a prefill worker
    r3 = httpx.post(f"{url}/generate", json={"input_ids": turn2, "sampling_params": {"max_new_tokens": 1}},
                    timeout=60).json()
    assert r3["meta_info"]["route"]["prefill"] != d1


@pytest.mark.parametrize("body, code", [
    ({"input_ids": [1, 2, 999]}, 400),
    ({"input_ids": []}, 400),
    ({"text": "a", "input_ids": [1]}, 400),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, 422),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, 422),
    ({"input_ids": [1], "sampling_params": {"unknown_field": 1}}, 422),
    ({"input_ids": [1], "lora_path": "adapter"}, 400),
    ({"input_ids": [1] * 9000}, 400),
])
def test_bad_generate_bodies_get_4xx_and_the_server_keeps_serving(cluster, body, code):
    url = cluster["url"]
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert r.status_code == code, r.text
    assert "error" in r.json()
    ok = httpx.post(f"{url}/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
                    timeout=60)
    assert ok.status_code == 200


def test_invalid_utf8_and_non_json_bodies(cluster):
    url = cluster["url"]
    # curl -d without a content type (form encoding) still means a JSON body here.
    r = httpx.post(f"{url}/generate", content=b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}',
                   headers={"content-type": "application/x-www-form-urlencoded"}, timeout=60)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
    r = httpx.post(f"{url}/generate", content=b"\xff\xfe{not json", headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "x", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_health_models_metrics(cluster):
    url = cluster["url"]
    assert httpx.get(f"{url}/health").json()["ok"] is True
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "strata-tiny"
    m = httpx.get(f"{url}/metrics").text
    assert "strata_requests_total" in m and "strata_ttft_seconds_bucket" in m and "strata_kv_pages_free" in m
    # Every worker (this cluster has L2) exports its load-back page counters, one series per kind.
    lb = [line for line in m.splitlines() if line.startswith("strata_kv_loadback_pages{")]
    workers = {line.split('worker="')[1].split('"')[0] for line in lb}
    assert len(workers) == 3 and "# TYPE strata_kv_loadback_pages gauge" in m, lb
    for kind in ("loaded", "used", "wasted", "deferred"):
        assert sum(f'kind="{kind}"' in line for line in lb) == len(workers), lb


def test_no_access_line_per_request_unless_asked(cluster):
    """server.access_log is off by default: Serve writes no line per request to the ingress replica's log
    (nor to its stderr, which Ray's log monitor reads); its other lines are still there."""
    import glob
    import re
    url = cluster["url"]
    for _ in range(3):
        assert httpx.get(f"{url}/v1/models").status_code == 200
    assert httpx.post(f"{url}/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}},
                      timeout=60).status_code == 200
    logs = ray._private.worker._global_node.get_logs_dir_path()
    files = glob.glob(f"{logs}/serve/replica_strata_ingress_*.log")
    assert files, sorted(glob.glob(f"{logs}/serve/*"))
    text = "".join(open(f, errors="replace").read() for f in files)
    assert text.strip(), files
    access = re.compile(r"\b(GET /v1/models|POST /generate) \d{3} [\d.]+ms")
    assert not access.search(text), access.search(text).group(0)


def test_haproxy_sends_no_metric_line_per_request(cluster):
    """HAProxy's per-request metric line to Serve's proxy actor is off (cluster/front.py front_env): the
    config HAProxy runs has no log target for it, and requests are still served and counted in /metrics."""
    import glob
    import os
    url = cluster["url"]
    assert httpx.post(f"{url}/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}},
                      timeout=60).status_code == 200
    d, f = os.path.split(os.environ["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"])
    files = [os.path.join(d, n["NodeID"], f) for n in ray.nodes() if n["Alive"]]   # this cluster's nodes'
    files = [p for p in files if os.path.isfile(p)]
    assert files, (sorted(glob.glob(os.path.join(d, "*"))), ray.nodes())
    for path in files:
        text = open(path).read()
        assert "frontend http_frontend" in text and "log-format-sd" not in text, path
        assert os.path.basename(os.environ["RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH"]) not in text, path
    assert "strata_requests_total" in httpx.get(f"{url}/metrics").text


def test_a_client_that_leaves_mid_stream_frees_the_decode_worker_at_once(cluster):
    """The stream's tokens come over the token channel; the client leaving cancels the request's one Ray
    call, which aborts it on the decode worker: nothing keeps decoding for nobody."""
    dec = cluster["workers"]["decode-0"]
    body = {"input_ids": [7, 7, 7], "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}, "stream": True}
    with httpx.stream("POST", f"{cluster['url']}/generate", json=body, timeout=60) as resp:
        got = 0
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                got += 1
                if got == 3:
                    assert ray.get(dec.load.remote()).running == 1
                    break
    deadline = time.monotonic() + 3.0   # 3000 tokens would take far longer
    while ray.get(dec.load.remote()).running:
        assert time.monotonic() < deadline, "the decode worker still runs the abandoned request"
        time.sleep(0.02)


def test_killing_the_decode_worker_mid_stream_gives_a_clean_error_and_it_comes_back(cluster):
    url = cluster["url"]
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
            "stream": True}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as resp:
        lines = resp.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: {"):
                got += 1
                if got == 3:
                    ray.kill(cluster["workers"]["decode-0"], no_restart=False)
            if line == "data: [DONE]":
                break
            if '"error"' in line:
                err = json.loads(line[6:])
                break
        else:
            pytest.fail("stream ended without an error or [DONE]")
    assert "request failed" in err["error"]["message"]
    deadline = time.time() + 60
    while time.time() < deadline:
        r = httpx.post(f"{url}/generate", json={"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 4}},
                       timeout=60)
        if r.status_code == 200:
            break
        time.sleep(1)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4


@pytest.mark.numerics
def test_a_non_streamed_request_survives_its_decode_worker_dying(cluster, reference):
    url = cluster["url"]
    ids = [9, 8, 7, 6]
    want = reference.generate([ids], SamplingParams(max_new_tokens=400, ignore_eos=True, return_logits=True))[0]

    def kill_soon():   # once the request decodes there (a fixed delay may outlast it and hit the next test)
        dec = cluster["workers"]["decode-0"]
        deadline = time.monotonic() + 60
        while ray.get(dec.load.remote()).running == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        ray.kill(dec, no_restart=False)

    import threading
    threading.Thread(target=kill_soon, daemon=True).start()
    r = httpx.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}, timeout=180)
    assert r.status_code == 200, r.text
    numerics.assert_same_output(r.json()["output_ids"], want, reference.model_config, "after a decode restart")
    assert "strata_request_retries_total" in httpx.get(f"{url}/metrics").text


def test_the_abcd_probe_hits_from_every_branch_point_through_the_cluster(cluster):
    """[branch]'s probe through `strata serve` (P/D): the prefill worker that computed P keeps its
    interior sliding KV and checkpoints, so B (P + 20 others), C (P + 200 others) and D (P's first 300
    tokens + 20) hit there as on one engine, and the router predicts each hit exactly."""
    import torch
    url = cluster["url"]
    g = torch.Generator().manual_seed(3301)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()   # noqa: E731
    p = rand(600)
    probes = [("A", p + rand(20)), ("B", p + rand(20)), ("C", p + rand(200)), ("D", p[:300] + rand(20))]
    # Earlier tests kill and restart workers: start once every worker serves again, so no probe is retried
    # (a retry would find its own first attempt's prompt cached, committed chunk by chunk).
    deadline = time.monotonic() + 60
    while True:
        h = httpx.get(f"{url}/health", timeout=10)
        warm = httpx.post(f"{url}/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}},
                          timeout=60)
        if h.status_code == 200 and warm.status_code == 200:
            break
        assert time.monotonic() < deadline, (h.text, warm.text)
        time.sleep(1.0)
    got = {}
    for name, ids in probes:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        meta = httpx.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]
        got[name] = meta
        time.sleep(0.5)  # the prefill worker's KV events reach the router within a report interval
    hits = {k: m["cached_tokens"] for k, m in got.items()}
    # A is cold; should it still have been retried, its second attempt finds the first's whole prompt.
    assert hits["A"] in (0, 608) and hits["B"] >= 584 and hits["C"] >= 584 and hits["D"] >= 288, got
    assert all(m["route"]["decode"] is not None for m in got.values()), got      # P/D, not colocated
    # The router predicts each hit exactly. Mostly all four go to A's prefill worker; a busy moment may send
    # one to the other, which holds none of P in L1/L2 and so must serve P's pages from L3 (this cluster
    # writes through to a shared store).
    assert {k: m["route"]["predicted_cached_tokens"] for k, m in got.items() if k != "A"} == \
        {k: v for k, v in hits.items() if k != "A"}, got
    for k, m in got.items():
        if m["route"]["prefill"] != got["A"]["route"]["prefill"]:
            d = m["cached_tokens_details"]
            assert d["device"] == 0 and d["host"] == 0 and d.get("storage", 0) == hits[k] > 0, (k, got)
