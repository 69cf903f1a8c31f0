"""KVManager (engine/kv_manager.py): every L1 page a request takes or gives back, over real tiny pools and
a real (L1-only) prefix cache, with check_integrity after every operation. No model runs: only pages move."""
import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine.kv_manager import KVManager
from engine.request import Request
from engine.sampling import SamplingParams
from storage.config import KVPoolConfig
from storage.geometry import KVGeometry
from storage.hicache import HiCache, NoCache
from storage.pools import KVPools
from storage.transfer.base import LeasedPages

PS, W = 4, 8
LAYERS = ("sliding_attention", "full_attention")


def make(num_pages=32, cache=True, checkpoint_interval=0):
    pools = KVPools(KVPoolConfig(page_size=PS, num_pages=num_pages, swa_full_ratio=0.5), LAYERS, 1, 2,
                    torch.float32, "cpu")
    geom = KVGeometry.from_layers(LAYERS, W, PS)
    hc = HiCache(pools, geom) if cache else None
    return KVManager(geom, pools, hc if hc is not None else NoCache(), checkpoint_interval=checkpoint_interval), hc


def check(kv, hc):
    tree = {c: {"tree": p} for c, p in hc.owners().items()} if hc is not None else {}
    kv.check_integrity(tree)


def run(kv, hc, req, n):
    """One step of ``n`` tokens as the engine takes it: extend, (forward), retire, advance, maybe sample."""
    ext = kv.extend(req, n)
    assert ext is not None
    check(kv, hc)
    s, e = req.num_computed, req.num_computed + n
    assert len(ext.full_pages) == -(-e // PS) and all(pos // PS * PS < e for pos, _, _ in ext.swa_write)
    assert [p for _, p, _ in ext.swa_write] == [req.pages.swa[pos // PS] for pos, _, _ in ext.swa_write]
    kv.after_forward()
    req.num_computed = e
    if e < req.seq_len and hc is not None:
        kv.commit(req, keep_end=False)   # a prompt's chunk: its interior sliding KV goes to the tree (Engine.step)
    if e == req.seq_len:
        req.output_ids.append(7)
        if len(req.output_ids) == 1:
            kv.commit(req)
    check(kv, hc)
    return ext


def req_of(rid, prompt):
    return Request(rid, list(prompt), SamplingParams(max_new_tokens=64, ignore_eos=True))


def test_extend_slides_the_window_and_release_gives_everything_back():
    kv, _ = make(cache=False)
    r = req_of("a", range(30))
    run(kv, None, r, 13)
    run(kv, None, r, 17)
    for _ in range(20):
        run(kv, None, r, 1)
        assert len(r.pages.owned_swa()) <= kv.geom.swa_pages_bound
        # only the pages the next step reads (the last W - 1 positions) are kept
        assert all(p is None for a, p in enumerate(r.pages.swa) if (a + 1) * PS <= r.num_computed - W + 1)
    assert len(r.pages.full) == -(-r.num_computed // PS)
    kv.release(r)
    check(kv, None)
    assert kv.pools.all_free() and not kv.holders


def test_commit_borrow_and_release_share_pages_with_the_cache():
    kv, hc = make()
    prompt = list(range(100, 126))
    a = req_of("a", prompt)
    run(kv, hc, a, 16)
    run(kv, hc, a, 10)                       # prompt done: commit hands its whole pages to the tree
    assert a.hit is not None and a.pages.num_shared_full == 26 // PS
    for _ in range(5):
        run(kv, hc, a, 1)
    kv.commit(a, finished=True)
    check(kv, hc)
    kv.release(a)
    check(kv, hc)
    assert a.hit is None and not kv.holders
    b = req_of("b", prompt + [1, 2, 3])
    hit = hc.match(b.tokens(0, b.seq_len), (b.seq_len - 1) // PS, 1.0)
    assert hit.num_pages == 26 // PS
    kv.borrow(b, hit)
    b.num_computed = hit.num_pages * PS
    check(kv, hc)
    assert b.pages.owned_full() == [] and b.pages.swa_valid_from <= b.num_computed - W + 1
    run(kv, hc, b, b.seq_len - b.num_computed)
    kv.release(b)                            # preempted: own pages freed, the hit unlocked
    check(kv, hc)
    hc.evict_l1("full", 10**6)
    hc.evict_l1("swa", 10**6)
    check(kv, hc)
    assert kv.pools.all_free()


def test_leased_pages_become_the_requests_table():
    kv, hc = make()
    n_full, first, n_swa = kv.geom.plan_pages(21)
    # A committed lease's pages (reserved from logical page `first`), the payload's window one page later.
    lease = LeasedPages("l", 21, kv.full.alloc(n_full), kv.swa.alloc(n_swa), first)
    q = req_of("q", range(21))
    kv.import_leased(q, lease, first + 1, (first + 1) * PS)
    assert q.pages.full == lease.full and q.pages.swa[:first + 1] == [None] * (first + 1)
    assert q.pages.swa[first + 1:] == lease.swa[1:] and kv.swa.num_used == n_swa - 1
    check(kv, hc)
    kv.release(q)
    # the window where the lease began
    lease = LeasedPages("m", 21, kv.full.alloc(n_full), kv.swa.alloc(n_swa), first)
    r = req_of("r", range(21))
    kv.import_leased(r, lease, first, first * PS)
    assert r.pages.swa[first:] == lease.swa and r.pages.swa[:first] == [None] * first
    check(kv, hc)
    kv.release(r)
    kv.give_back({"full": kv.full.alloc(2)})
    check(kv, hc)
    assert kv.pools.all_free()


def test_integrity_catches_a_page_owned_twice():
    kv, hc = make()
    a, b = req_of("a", range(10)), req_of("b", range(10))
    run(kv, hc, a, 5)
    run(kv, hc, b, 5)
    # Page 0 is the tree's now (both chunks committed it); page 1, begun by each, is each one's own.
    b.pages.full[1] = a.pages.full[1]
    with pytest.raises(AssertionError):
        check(kv, hc)


PROMPTS = [list(range(3, 3 + n)) for n in (9, 17, 26)] + [list(range(40, 62))]


class PagesMachine(RuleBasedStateMachine):
    """Random admissions (with prefix hits), chunks, decodes, finishes, preemptions and evictions."""

    @initialize(num_pages=st.integers(12, 40), cache=st.booleans(), every=st.sampled_from([0, 4, 8, 13]))
    def setup(self, num_pages, cache, every):
        self.kv, self.hc = make(num_pages, cache, every)   # checkpoints every 1-3 pages, or the default
        self.waiting, self.running, self.n = [], [], 0

    @rule(k=st.integers(0, len(PROMPTS) - 1), extra=st.integers(0, 5), ends=st.sets(st.integers(1, 9), max_size=3))
    def add(self, k, extra, ends):
        if len(self.waiting) + len(self.running) < 4:
            self.n += 1
            r = req_of(f"r{self.n}", PROMPTS[k] + list(range(extra)))
            r.boundaries = tuple(sorted(ends))   # message ends: kept windows
            self.waiting.append(r)

    @rule(chunk=st.integers(1, 12))
    def admit(self, chunk):
        if not self.waiting:
            return
        r = self.waiting[0]
        if self.hc is not None:
            hit = self.hc.match(r.tokens(0, r.seq_len), (r.seq_len - 1) // PS, float(self.n))
            if hit.num_pages:
                self.kv.borrow(r, hit)
                r.num_computed = hit.num_pages * PS
            else:
                self.hc.release(hit)
        if self.kv.extend(r, min(chunk, r.remaining)) is None:
            self.kv.release(r)
            r.num_computed = 0
            return
        self.kv.after_forward()
        self.waiting.pop(0)
        self.running.append(r)
        self._advance(r, min(chunk, r.remaining))

    def _advance(self, r, n):
        r.num_computed += n
        if r.num_computed < r.seq_len and not r.output_ids and self.hc is not None:
            self.kv.commit(r, keep_end=False)   # a prompt's chunk (Engine.step)
        if r.num_computed == r.seq_len:
            r.output_ids.append(11)
            if len(r.output_ids) == 1:
                self.kv.commit(r)

    @rule(i=st.integers(0, 3), chunk=st.integers(1, 12))
    def step(self, i, chunk):
        if not self.running:
            return
        r = self.running[i % len(self.running)]
        n = min(chunk, r.remaining)
        if self.kv.extend(r, n) is None:
            self.preempt(0)
            return
        self.kv.after_forward()
        self._advance(r, n)

    @rule(i=st.integers(0, 3))
    def finish(self, i):
        if self.running:
            r = self.running.pop(i % len(self.running))
            self.kv.commit(r, finished=True)
            self.kv.release(r)

    @rule(i=st.integers(0, 3))
    def preempt(self, i):
        if self.running:
            r = self.running.pop(i % len(self.running))
            self.kv.release(r)
            r.num_computed = 0
            self.waiting.insert(0, r)

    @rule(comp=st.sampled_from(["full", "swa"]), n=st.integers(1, 8))
    def evict(self, comp, n):
        if self.hc is not None:
            self.hc.evict_l1(comp, n)

    @invariant()
    def integrity(self):
        if hasattr(self, "kv"):
            check(self.kv, self.hc)
            assert set(self.kv.holders) == {r.rid for r in self.running}

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for r in self.running + self.waiting:
            self.kv.release(r)
        if self.hc is not None:
            self.hc.evict_l1("full", 10**6)
            self.hc.evict_l1("swa", 10**6)
        check(self.kv, self.hc)
        assert self.kv.pools.all_free() and not self.kv.holders


TestPagesMachine = PagesMachine.TestCase
TestPagesMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
