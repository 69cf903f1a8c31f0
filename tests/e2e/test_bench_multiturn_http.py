"""bench/multiturn.py against the real cluster of this package (2 prefill + 1 decode), both APIs:
a few short conversations, every request answered, the cache hit from round 2 on."""
import asyncio

import pytest

from bench.multiturn import run_workload
from bench.multiturn_workload import WorkloadConfig, summarize


@pytest.mark.parametrize("api", ["generate", "chat"])
def test_multiturn_client_measures_a_real_server(cluster, api):
    wl = WorkloadConfig(num_clients=3, num_rounds=2, request_length=160, sub_question_length=24, output_length=6,
                        max_parallel=2, request_rate=50.0, seed=7, api=api)
    server: dict = {}
    records, dur = asyncio.run(run_workload(cluster["url"], wl, progress=False, timeout=60, server=server))
    s = summarize(records, dur)
    assert s["requests"] == 6 and s["errors"] == 0, [r.error for r in records]
    for r in records:
        assert r.ttft is not None and 0 < r.ttft <= r.latency
        assert 0 <= r.cached_tokens < r.prompt_tokens and r.output_tokens >= 1
    if api == "generate":
        assert all(r.output_tokens == 6 for r in records)
        assert all(r.prompt_tokens >= 160 for r in records)
    round2 = next(p for p in s["per_round"] if p["round"] == 2)
    assert round2["hit_rate"] > 0.5, s["per_round"]
    # The cluster's /metrics tell the host memory the conversations take and the L1 -> L2 traffic.
    assert server["host_kv_bytes_per_conversation"] > 0 and server["kv_moved_bytes"]["L1->L2"] > 0
