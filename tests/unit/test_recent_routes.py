"""The prompts just routed count as held by their worker until its KV events can have caught up
(actors/recent_routes.py): a repeat before the worker's second report goes where the first went."""
import hashlib

import pytest

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from actors.prefix_router import Router
from actors.recent_routes import RecentRoutes
from actors.routing import RouterConfig
from engine.worker_load import WorkerLoad
from storage.geometry import KVGeometry
from storage.kv_events.subscriber import Delivered
from storage.kv_events.wire import AllBlocksCleared, BlockStored, EventBatch


def blocks(tokens) -> list[int]:
    """Chained block ids, one per token here: each names its page and every page before it."""
    out = []
    for i in range(len(tokens)):
        out.append(int.from_bytes(hashlib.blake2b(bytes(tokens[:i + 1]), digest_size=8).digest(), "big"))
    return out


def two_prefill(cfg: RouterConfig) -> Router:
    r = Router(cfg, KVGeometry(16))
    for w, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
        r.report(w, role, WorkerLoad(queued_tokens=0, free_pages=100), True, now=0.0)
    return r


def test_a_repeat_before_the_events_goes_where_the_first_went_until_two_reports():
    keys = blocks([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    r = two_prefill(RouterConfig())
    first = r.route(keys, 200, now=1.0)
    assert first.prefill == "p0" and first.cached_pages == 0
    again = r.route(keys, 200, now=1.01)     # p0's events not in yet, and its queue is longer
    assert again.prefill == "p0" and again.cached_pages == 12 and again.by_tier["L1"] == 12
    turn = r.route(blocks([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]), 230, now=1.02)
    assert turn.prefill == "p0" and turn.cached_pages == 12      # the next turn: the prefix it was sent
    r.recent.check_integrity()
    assert r.route(blocks([9, 9, 9]), 200, now=1.03).prefill == "p1"    # another prompt: by load
    # p0's first report may carry events taken before the route: the routes still count
    r.report("p0", "prefill", WorkerLoad(queued_tokens=400), False, now=1.05)
    assert r.recent.pages(keys, ["p0", "p1"]) == {"p0": 12}
    r.recent.check_integrity()
    # its second report's events were taken after the route: the index alone speaks (here: evicted)
    r.report("p0", "prefill", WorkerLoad(queued_tokens=400), False, now=1.1)
    late = r.route(keys, 200, now=1.11)
    assert late.prefill == "p1" and late.cached_pages == 0
    r.recent.check_integrity()


def test_off_it_is_the_index_alone_and_the_events_still_count():
    keys = blocks([1, 2, 3, 4])
    r = two_prefill(RouterConfig(recent_reports=0))
    assert r.route(keys, 64, now=1.0).prefill == "p0"
    assert r.route(keys, 64, now=1.01).prefill == "p1"      # p0's queue, and no events yet
    r.apply([Delivered("p1", 0, EventBatch(0.0, [BlockStored(keys, None, [], 16, medium="GPU")]))])
    assert r.route(keys, 64, now=1.02).prefill == "p1"
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="recent_reports"):
            RouterConfig(recent_reports=bad)


def test_round_robin_keeps_no_recent_routes():
    keys = blocks([1, 2, 3, 4])
    r = two_prefill(RouterConfig(policy="round_robin"))
    assert [r.route(keys, 64, now=1.0 + i / 100).prefill for i in range(3)] == ["p0", "p1", "p0"]
    assert r.recent.pages(keys, ["p0", "p1"]) == {}
    r.recent.check_integrity()


def test_a_worker_removed_silent_or_restarted_loses_what_it_was_sent():
    keys = blocks([5, 6, 7, 8])
    r = two_prefill(RouterConfig())
    assert r.route(keys, 64, now=1.0).prefill == "p0"
    r.report("p0", "prefill", WorkerLoad(queued_tokens=64), True, now=1.01)   # a new incarnation: an empty tree
    assert r.recent.pages(keys, ["p0", "p1"]) == {}
    assert r.route(keys, 64, now=1.02).prefill == "p1"
    r.remove_worker("p1")
    assert r.recent.pages(keys, ["p0", "p1"]) == {}
    assert r.route(keys, 64, now=1.03).prefill == "p0"
    r.report("d0", "decode", WorkerLoad(free_pages=100), False, now=20.0)
    assert r.status(now=20.0)["workers"]["p0"]["live"] is False        # p0 silent past stale_after
    assert r.recent.pages(keys, ["p0"]) == {}
    r.recent.check_integrity()


def test_a_flush_or_a_snapshot_makes_the_index_exact_again():
    keys = blocks([5, 6, 7, 8])
    r = two_prefill(RouterConfig())
    assert r.route(keys, 64, now=1.0).prefill == "p0"
    r.apply([Delivered("p0", 0, EventBatch(0.0, [AllBlocksCleared()]))])    # /flush_cache on p0
    assert r.route(keys, 64, now=1.01).cached_pages == 0


class RecentModel(RuleBasedStateMachine):
    """RecentRoutes against the rule written out: a prompt's match on a worker is its longest prefix whose
    every block was routed there (in some prompt) after the worker was last forgotten, fewer than
    ``REPORTS`` of its reports ago."""

    REPORTS = 2

    @initialize()
    def start(self):
        self.r = RecentRoutes(self.REPORTS)
        self.sent: list[tuple[str, tuple, int]] = []     # (worker, blocks, its reports at the route)
        self.count = {"a": 0, "b": 0}
        self.forgot: dict[str, int] = {}     # worker -> len(sent) when it was last forgotten

    @rule(w=st.sampled_from(["a", "b"]), tokens=st.lists(st.integers(0, 2), max_size=6))
    def route(self, w, tokens):
        keys = blocks(tokens)
        self.r.add(w, keys)
        self.sent.append((w, tuple(keys), self.count[w]))

    @rule(w=st.sampled_from(["a", "b"]))
    def report(self, w):
        self.r.reported(w)
        self.count[w] += 1

    @rule(w=st.sampled_from(["a", "b"]))
    def forget(self, w):
        self.r.forget(w)
        self.forgot[w] = len(self.sent)

    @rule(tokens=st.lists(st.integers(0, 2), max_size=7))
    def match(self, tokens):
        keys = blocks(tokens)
        got = self.r.pages(keys, ["a", "b"])
        for w in ("a", "b"):
            held = {k for sw, ks, c in self.sent[self.forgot.get(w, 0):]
                    if sw == w and self.count[w] < c + self.REPORTS for k in ks}
            n = 0
            while n < len(keys) and keys[n] in held:
                n += 1
            assert got.get(w, 0) == n, (w, got, n)

    @invariant()
    def integrity(self):
        self.r.check_integrity()


RecentModel.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestRecentModel = RecentModel.TestCase
