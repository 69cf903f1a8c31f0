"""bench/router.py on a small stream (a smoke run: the figures are bench/results/router.json's)."""
import random

from bench import router as bench


def test_strata_and_dynamo_read_one_stream_and_agree_on_full_pages():
    rows, check = bench.scale_rows(1_000, 0.05, random.Random(0))
    by = {r["impl"]: r for r in rows}
    assert by["strata route"]["indexed_pages"] >= 800 and by["strata route"]["decisions_per_s"] > 0
    assert check["conversations_alive"] > 0
    if bench.DYNAMO_SKIPPED:
        assert set(by) == {"strata route", "strata overlap"}
    else:
        assert check["full_only_disagreements"] == 0 and by["dynamo"]["decisions_per_s"] > 0


def test_the_hybrid_row_predicts_what_the_worker_delivers():
    row = bench.hybrid_row(True, 0.15)
    assert row["requests"] == 12 and row["strata_mispredicted"] == 0
    assert row["strata_predicted_hit_rate"] == row["delivered_hit_rate"] > 0
    if not bench.DYNAMO_SKIPPED:
        assert row["dynamo_predicted_hit_rate"] >= row["delivered_hit_rate"]
