"""The multi-turn benchmark's workload generator and statistics (pure: no server, no clock)."""
import math
import statistics

import pytest

from bench.compare_report import checks, row_of
from bench.multiturn import _events, metric_sum, parse_metrics, server_side
from bench.multiturn_workload import (RequestRecord, TurnQueue, WorkloadConfig, arrival_gaps, hit_rate,
                                      make_conversations, percentile, random_text, summarize)


def test_conversations_are_seeded_and_sized():
    cfg = WorkloadConfig(num_clients=3, num_rounds=3, request_length=100, sub_question_length=20)
    a, b = make_conversations(cfg), make_conversations(cfg)
    assert [c.questions for c in a] == [c.questions for c in b]
    assert make_conversations(WorkloadConfig(num_clients=3, seed=1))[0].questions != \
        make_conversations(WorkloadConfig(num_clients=3, seed=0))[0].questions
    for c in a:
        assert [len(q) for q in c.questions] == [100, 20, 20]
    assert len({c.questions[0] for c in a}) == 3            # every client its own text
    # Adding clients leaves the first ones' text alone.
    more = make_conversations(WorkloadConfig(num_clients=5, num_rounds=3, request_length=100, sub_question_length=20))
    assert [c.questions for c in more[:3]] == [c.questions for c in a]


def test_each_round_extends_the_previous_prompt():
    conv = make_conversations(WorkloadConfig(num_clients=1, num_rounds=3, request_length=50,
                                             sub_question_length=10))[0]
    p1 = conv.prompt()
    assert p1 == conv.questions[0]
    conv.answer("ANSWER-1")
    p2 = conv.prompt()
    assert p2.startswith(p1 + "ANSWER-1") and p2.endswith(conv.questions[1])
    msgs = conv.messages()
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"] and msgs[1]["content"] == "ANSWER-1"
    conv.answer("A2")
    conv.answer("A3")
    with pytest.raises(ValueError):
        conv.answer("A4")


def test_random_text_is_exact_length_words():
    import random
    t = random_text(random.Random(0), 257)
    assert len(t) == 257 and set(t) <= set("abcdefghijklmnopqrstuvwxyz ") and "  " not in t


def test_poisson_gaps_have_the_rate_and_the_seed():
    g = arrival_gaps(4.0, 4000, seed=1)
    assert g == arrival_gaps(4.0, 4000, seed=1) and g != arrival_gaps(4.0, 4000, seed=2)
    assert abs(statistics.fmean(g) - 0.25) < 0.02 and min(g) >= 0
    assert arrival_gaps(math.inf, 3, seed=0) == [0.0, 0.0, 0.0]


def _drain(q: TurnQueue, order_of_finish) -> list:
    sent = []
    while not q.finished:
        while (item := q.pop()) is not None:
            sent.append(item)
        in_flight = sorted(q.in_flight, key=order_of_finish)
        q.finish(in_flight[0])
    return sent


def test_turn_queue_without_barrier_lets_a_fast_client_run_ahead():
    q = TurnQueue(2, 3)
    assert q.pop() == (0, 0) and q.pop() == (1, 0) and q.pop() is None
    q.finish(0)
    assert q.pop() == (0, 1)                 # client 1 has not answered yet: 0 goes on alone
    q.finish(0)
    assert q.pop() == (0, 2)
    with pytest.raises(ValueError):
        q.finish(0) or q.finish(0)
    sent = _drain(TurnQueue(3, 4), order_of_finish=lambda c: c)
    assert sorted(sent) == [(c, r) for c in range(3) for r in range(4)]


def test_turn_queue_barrier_opens_a_round_only_when_all_finished():
    q = TurnQueue(3, 2, barrier=True)
    assert [q.pop() for _ in range(3)] == [(0, 0), (1, 0), (2, 0)]
    q.finish(2)
    q.finish(0)
    assert q.pop() is None                   # client 1 is still in round 1
    q.finish(1)
    assert [q.pop() for _ in range(3)] == [(0, 1), (1, 1), (2, 1)]
    for c in (1, 0, 2):
        q.finish(c)
    assert q.finished and q.pop() is None


def test_percentiles_and_summary():
    assert percentile([], 50) != percentile([], 50)          # nan
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5
    assert percentile(list(range(101)), 90) == 90 and percentile([3, 1, 2], 100) == 3
    recs = [RequestRecord(0, 1, 0.0, prompt_tokens=100, cached_tokens=0, output_tokens=10, ttft=0.5, latency=1.0,
                          itl=[0.05] * 9),
            RequestRecord(0, 2, 1.0, prompt_tokens=200, cached_tokens=160, output_tokens=10, ttft=0.1, latency=0.6,
                          itl=[0.05] * 9),
            RequestRecord(1, 2, 1.0, prompt_tokens=200, cached_tokens=200, output_tokens=10, ttft=0.3, latency=0.8,
                          itl=[0.07] * 9),
            RequestRecord(1, 1, 0.0, error="HTTP 503")]
    s = summarize(recs, duration=2.0)
    assert s["requests"] == 4 and s["errors"] == 1
    assert s["hit_rate"] == pytest.approx(360 / 500)
    assert [p["round"] for p in s["per_round"]] == [1, 2]
    assert s["per_round"][1]["hit_rate"] == pytest.approx(0.9) and s["per_round"][1]["ttft_mean_s"] == pytest.approx(0.2)
    assert s["ttft_s"]["mean"] == pytest.approx(0.3) and s["ttft_s"]["p50"] == pytest.approx(0.3)
    assert s["input_tokens_per_s"] == pytest.approx(250) and s["output_tokens_per_s"] == pytest.approx(15)
    assert s["itl_s"]["mean"] == pytest.approx((0.05 * 18 + 0.07 * 9) / 27)
    assert hit_rate([]) != hit_rate([])


def test_sse_lines():
    assert _events('data: {"text": "ab"}') == {"text": "ab"}
    assert _events("data: [DONE]") is None and _events("") is None and _events(": ping") is None


def test_workload_config_is_validated():
    for kw in ({"num_clients": 0}, {"max_parallel": 0}, {"request_rate": 0}, {"api": "grpc"},
               {"output_length": 1.5}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            WorkloadConfig(**kw)


def _result(name, hits, ttfts, host=1000.0, swa=0.0):
    per = [{"round": i + 1, "requests": 2, "hit_rate": h, "ttft_mean_s": t, "ttft_p50_s": t, "prompt_tokens_mean": 1}
           for i, (h, t) in enumerate(zip(hits, ttfts))]
    summ = {"per_round": per, "errors": 0, "ttft_s": {"mean": statistics.fmean(ttfts)}, "itl_s": {"mean": 0.01},
            "input_tokens_per_s": 1.0}
    return {"name": name, "summary": summ, "host_bytes_per_conversation": host,
            "host_swa_bytes_per_conversation": swa,
            "bytes_moved": {"L1->L2": 0, "L2->L1": 0, "L2->L3 (stored)": 0},
            "hit_tokens_by_tier": {"L1": 0, "L2": 0, "L3": 0}}


def test_compare_checks_pass_and_fail_on_the_numbers():
    factor = {"one_window": 0.55, "one_window_per_round": 0.7, "tokens_per_conversation": 800}
    good = [_result("no cache", [0, 0, 0], [1.0, 1.2, 1.4]),
            _result("L1+L2", [0, 0.85, 0.9], [1.0, 0.3, 0.3], host=600),
            _result("L1+L2 SWA-oblivious", [0, 0.85, 0.9], [1.0, 0.3, 0.3], host=1000),
            _result("2P prefix router", [0, 0.9, 0.9], [1, 1, 1]),
            _result("2P round-robin", [0, 0.2, 0.6], [1, 1, 1])]
    assert all(c["ok"] for c in checks(good, factor)) and len(checks(good, factor)) == 4
    bad = [_result("no cache", [0, 0, 0], [1.0, 0.2, 0.2]),
           _result("L1+L2", [0, 0.7, 0.9], [1.0, 0.3, 0.3], host=900),
           _result("L1+L2 SWA-oblivious", [0, 0.85, 0.9], [1.0, 0.3, 0.3], host=1000),
           _result("2P prefix router", [0, 0.2, 0.2], [1, 1, 1]),
           _result("2P round-robin", [0, 0.2, 0.6], [1, 1, 1])]
    assert not any(c["ok"] for c in checks(bad, factor))
    row = row_of(good[1], 3)
    assert row["hit r2"] == 0.85 and row["ttft r2+ ms"] == pytest.approx(300)


def test_cli_rejects_a_bad_workload_before_sending_anything(capsys):
    from bench.multiturn import main
    assert main(["--url", "http://127.0.0.1:9", "--num-clients", "0"]) == 2
    assert "num_clients" in capsys.readouterr().err


def test_metrics_parsing_and_the_server_side_figures():
    text = """# TYPE strata_host_kv_bytes gauge
strata_host_kv_bytes{worker="prefill-0",role="prefill"} 3000.0
strata_host_kv_bytes{worker="decode-0",role="decode"} 1000
strata_kv_moved_bytes{worker="prefill-0",role="prefill",direction="L1->L2"} 500
strata_kv_moved_bytes{worker="decode-0",role="decode",direction="L1->L2"} 100
strata_kv_moved_bytes{worker="decode-0",role="decode",direction="L2->L1"} 40
strata_requests_total 7
"""
    m = parse_metrics(text)
    assert metric_sum(m, "strata_host_kv_bytes") == 4000 and metric_sum(m, "strata_requests_total") == 7
    assert metric_sum(m, "strata_kv_moved_bytes", direction="L1->L2", worker="decode-0") == 100
    before = parse_metrics('strata_kv_moved_bytes{worker="decode-0",role="decode",direction="L1->L2"} 50\n')
    s = server_side(before, m, num_clients=4)
    assert s == {"host_kv_bytes_per_conversation": 1000, "kv_moved_bytes": {"L1->L2": 550, "L2->L1": 40}}
    assert server_side({}, parse_metrics("strata_requests_total 3\n"), 4) == {}
