"""L3 prefetch through the engine: a request whose prefix continues in L3 waits (others keep stepping)
while its pages are read into L2 in the background, and starts when the prefetch policy says so --
always with the greedy tokens of a recomputation, whatever prefix it ends up using."""
from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch

from engine import Engine, SamplingParams
from engine.request import Status
from storage.config import HiCacheConfig
from storage.hicache.prefetch import find_cuts, prefetch_ready, usable_end
from storage.l3 import L3Config, l3_key
from storage.l3.base import key_digest
from storage.l3.file import FileStore
from tests import numerics

SP = SamplingParams(max_new_tokens=8, ignore_eos=True)
PS = 16


def _engine(path, **l3):
    l3.setdefault("prefetch_policy", "wait_complete")
    return Engine.from_pretrained("strata-tiny", page_size=PS, num_pages=256, enable_prefix_cache=True,
                                  poison_kv=True,
                                  hicache=HiCacheConfig(host_pages=256, l3=L3Config(backend="file", path=str(path),
                                                                                    **l3)))


@pytest.fixture(scope="module")
def ref():
    return Engine.from_pretrained("strata-tiny", page_size=PS, num_pages=256)


@pytest.fixture(scope="module")
def written(tmp_path_factory, ref):
    """Engine A served an 8-window prompt and wrote it through L2 to L3; the second turn and its tokens."""
    root = tmp_path_factory.mktemp("l3src")
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 256, (8 * 64,), generator=g).tolist()
    a = _engine(root)
    first = a.generate([prompt], SP)[0]
    a.cache.poll(block=True)
    assert a.cache.l3.stats["written_pages"] > 0
    a.close()
    turn2 = prompt + first.token_ids + [11] * 24
    return root, prompt, turn2, ref.generate([turn2], numerics.with_logits(SP))[0]


@pytest.fixture
def l3dir(written, tmp_path):
    """A private copy of the written store (engines under test write to it too)."""
    dst = tmp_path / "l3"
    shutil.copytree(written[0], dst)
    return dst


def _done(eng: Engine) -> None:
    eng.check_integrity()
    eng.flush_cache()
    assert eng.pools.all_free() and eng.cache.host.all_free()
    eng.check_integrity()
    eng.close()


class GatedFileStore(FileStore):
    """The real file store, with every read held until the test opens the gate (a slow store)."""

    def __init__(self, cfg, gate: threading.Event) -> None:
        super().__init__(cfg)
        self.gate = gate

    def _get(self, keys, pages):
        self.gate.wait(120)
        return super()._get(keys, pages)


def _gate(eng: Engine) -> threading.Event:
    gate = threading.Event()
    tier = eng.cache.l3
    tier.store.close()
    tier.store = GatedFileStore(tier.store.cfg, gate)
    return gate


# ---- the policy, pure -----------------------------------------------------------------------------------
def test_policy_decisions():
    for policy in ("best_effort", "wait_complete", "timeout"):
        assert prefetch_ready(policy, True, 0, 0.0, 10.0)        # everything arrived: go
    assert not prefetch_ready("best_effort", False, 0, 0.0, 10.0)  # the schedule that started it waits
    assert prefetch_ready("best_effort", False, 1, 0.0, 10.0)      # the next one goes
    assert not prefetch_ready("wait_complete", False, 99, 1e9, 10.0)
    assert not prefetch_ready("timeout", False, 5, 9.9, 10.0)
    assert prefetch_ready("timeout", False, 5, 10.0, 10.0)
    with pytest.raises(ValueError, match="policy"):
        prefetch_ready("eager", False, 0, 0.0, 0.0)


def test_usable_prefix_needs_the_last_window():
    assert usable_end(4, 10, 6, [10], 3) == 10        # all arrived, window too
    assert usable_end(4, 10, 5, [10], 3) == 4         # a full page missing: its window is not usable
    assert usable_end(4, 10, 6, [], 3) == 4           # the window failed
    assert usable_end(4, 10, 3, [], 0) == 7           # no SWA: the arrived prefix
    assert usable_end(4, 4, 0, [], 3) == 4
    # Partial on a hybrid model: the longest arrived prefix whose own last window arrived.
    assert usable_end(4, 10, 5, [7, 10], 3) == 7
    assert usable_end(4, 10, 2, [7, 10], 3) == 4      # page 6 not there yet: 7 is not usable either
    assert usable_end(4, 10, 6, [7], 3) == 7          # the final window failed, an earlier one arrived


def test_cuts_are_the_points_whose_window_the_store_holds():
    held = {2, 3, 4, 8, 9, 10, 11}                    # SWA pages in L3: the windows of earlier sequences

    def exists(lo, hi):
        n = 0
        while lo + n < hi and lo + n in held:
            n += 1
        return n
    assert find_cuts(exists, 1, 12, 3) == [5, 11, 12]
    assert find_cuts(exists, 5, 12, 3) == [11, 12]
    assert find_cuts(exists, 0, 8, 3) == [5]
    assert find_cuts(exists, 0, 3, 3) == []           # [0, 3) lacks pages 0 and 1


def test_config_validation():
    with pytest.raises(ValueError, match="prefetch_policy"):
        L3Config(prefetch_policy="eager")
    with pytest.raises(ValueError, match="prefetch_timeout_base"):
        L3Config(prefetch_timeout_base=0)
    with pytest.raises(ValueError, match="prefetch_timeout_per_ki_token"):
        L3Config(prefetch_timeout_per_ki_token=-1)
    with pytest.raises(ValueError, match="prefetch_min_tokens"):
        L3Config(prefetch_min_tokens=-1)
    cfg = L3Config(prefetch_timeout_base=2.0, prefetch_timeout_per_ki_token=0.5)
    assert cfg.prefetch_deadline(100.0, 4096) == pytest.approx(104.0)


# ---- through the engine ----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["wait_complete", "timeout"])
@pytest.mark.numerics
def test_whole_prefix_from_l3(policy, written, l3dir, ref):
    _, prompt, turn2, want = written
    b = _engine(l3dir, prefetch_policy=policy, prefetch_timeout_base=600.0)
    got = b.generate([turn2], SP)[0]
    numerics.assert_same_output(got, want, ref.model_config)
    assert got.cached_tokens_by_tier == {"L1": 0, "L2": 0, "L3": PS * (len(prompt) // PS)}
    assert b.stats()["cache"]["usage"]["L3"]["prefetch_pages_taken"] == len(prompt) // PS
    _done(b)


def test_a_run_past_l1_l2_shorter_than_prefetch_min_tokens_is_recomputed_not_looked_up(written, l3dir):
    """L3 holds the first 256 tokens (a kept window ends there). Past an empty L1/L2 that is too short to
    wait a lookup for under prefetch_min_tokens=512: the request starts at once and computes it. At 256
    it is looked up and read."""
    _, prompt, _, _ = written
    turn = prompt[:16 * PS] + [5] * 8
    for min_tokens, started, from_l3 in ((512, 0, 0), (256, 1, 16 * PS)):
        b = _engine(l3dir, prefetch_min_tokens=min_tokens)
        r = b.add_request(turn, SP)
        b.step()
        assert b.requests[r].status is not Status.WAITING or started   # not held back for a lookup
        while b.has_unfinished():
            b.step()
        out = b.pop_finished(r)
        assert b.cache.l3.prefetcher.stats["started"] == started
        assert out.cached_tokens_by_tier["L3"] == from_l3, (min_tokens, out.cached_tokens_by_tier)
        _done(b)


@pytest.mark.numerics
def test_best_effort_takes_what_arrived(written, l3dir, ref):
    _, prompt, turn2, want = written
    b = _engine(l3dir, prefetch_policy="best_effort")
    got = b.generate([turn2], SP)[0]
    numerics.assert_same_output(got, want, ref.model_config)
    # Hybrid model: usable only up to a point whose last window arrived; L3 holds one (the prompt's): all or nothing.
    assert got.cached_tokens_by_tier["L3"] in (0, PS * (len(prompt) // PS))
    _done(b)


@pytest.mark.numerics
def test_waiting_request_does_not_block_others(written, l3dir, ref):
    _, prompt, turn2, want = written
    b = _engine(l3dir, prefetch_policy="wait_complete")
    gate = _gate(b)
    other = [(5 * i) % 256 for i in range(40)]
    r = b.add_request(turn2, SP)
    o = b.add_request(other, SamplingParams(max_new_tokens=4, ignore_eos=True))
    for _ in range(10_000):
        if b.requests[o].status is Status.FINISHED:
            break
        b.step()
    assert b.requests[o].status is Status.FINISHED      # it stepped while the L3 read was held
    numerics.assert_same_output(b.output(o), ref.generate([other], numerics.with_logits(
        SamplingParams(max_new_tokens=4, ignore_eos=True)))[0], ref.model_config)
    assert b.requests[r].status is Status.WAITING and b.requests[r].num_computed == 0
    b.check_integrity()
    gate.set()
    while b.requests[r].status is not Status.FINISHED:
        b.step()
    out = b.pop_finished(r)
    numerics.assert_same_output(out, want, ref.model_config)
    assert out.cached_tokens_by_tier["L3"] == PS * (len(prompt) // PS)
    _done(b)


@pytest.mark.numerics
def test_timeout_with_slow_store_uses_shorter_prefix(written, l3dir, ref):
    _, prompt, turn2, want = written
    b = _engine(l3dir, prefetch_policy="timeout", prefetch_timeout_base=0.05, prefetch_timeout_per_ki_token=0.0)
    gate = _gate(b)                                      # every L3 read is held past the deadline
    local = b.generate([prompt[:160]], SP)[0]            # so B computes the first 10 pages itself (L1)
    assert local.cached_tokens_by_tier["L3"] == 0
    got = b.generate([turn2], SP)[0]
    numerics.assert_same_output(got, want, ref.model_config)
    assert got.cached_tokens_by_tier["L3"] == 0 and got.cached_tokens == PS * 10
    assert got.cached_tokens < PS * (len(prompt) // PS)
    gate.set()
    _done(b)


def _flip_a_byte(eng, l3dir, key) -> None:
    """Corrupt the stored full page of ``key`` in a file L3 (one bit near its end)."""
    name = key_digest(l3_key(eng.model_id(), "full", key)).hex()
    path = os.path.join(l3dir, "v1", name[:2], name[2:])
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) - 7)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.numerics
def test_corrupt_page_mid_prefix_ends_it(written, l3dir, ref):
    _, prompt, turn2, want = written
    b = _engine(l3dir)
    keys = b.cache.tree.page_keys(prompt)
    _flip_a_byte(b, l3dir, keys[12])
    got = b.generate([turn2], SP)[0]
    numerics.assert_same_output(got, want, ref.model_config)
    # Pages 0..11 arrived, but their last window was never fetched (only the prompt's is): nothing usable.
    assert got.cached_tokens_by_tier["L3"] == 0
    assert b.cache.l3.store.stats()["corrupt"] == 1
    _done(b)


def _dir_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
               if not f.startswith("."))


@pytest.mark.numerics
def test_file_store_never_exceeds_its_cap(tmp_path, ref):
    probe = _engine(tmp_path / "probe")
    page = probe.cache.host.pool("full").page_bytes + 64
    probe.close()
    cap = 24 * page                                      # each prompt below writes ~20 pages
    b = _engine(tmp_path / "l3", capacity_bytes=cap)
    g = torch.Generator().manual_seed(3)
    for i in range(6):
        p = torch.randint(0, 256, (250,), generator=g).tolist()
        numerics.assert_same_output(b.generate([p], SP)[0], ref.generate([p], numerics.with_logits(SP))[0],
                                    ref.model_config)
        b.cache.poll(block=True)
        assert 0 < _dir_bytes(tmp_path / "l3") <= cap
    st = b.cache.l3.store.stats()
    assert st["evictions"] > 0 and st["sets_ok"] * page > 3 * cap   # several times the cap went through
    _done(b)


def test_abort_while_prefetching_frees_everything(written, l3dir):
    _, prompt, turn2, want = written
    b = _engine(l3dir)
    gate = _gate(b)
    r = b.add_request(turn2, SP)
    for _ in range(3):
        b.step()
    assert b.requests[r].status is Status.WAITING and b.cache.prefetching()
    b.check_integrity()                                  # host pages of the read in flight are owned
    assert b.abort(r)
    b.pop_finished(r)
    b.check_integrity()
    gate.set()
    b.cache.poll(block=True)
    assert b.cache.host.all_free() and b.pools.all_free()
    _done(b)


@pytest.mark.numerics
def test_pages_only_l3_still_holds_come_back(tmp_path, ref):
    """Small L1 and L2: an early conversation falls out of both (its nodes keep only the L3 flag); coming
    back to it prefetches it from L3 into those nodes."""
    b = Engine.from_pretrained("strata-tiny", page_size=PS, num_pages=48, enable_prefix_cache=True, poison_kv=True,
                               hicache=HiCacheConfig(host_pages=64, l3=L3Config(backend="file", path=str(tmp_path),
                                                                               prefetch_policy="wait_complete")))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (300,), generator=g).tolist() for _ in range(6)]
    outs = [b.generate([p], SP)[0] for p in prompts]
    for p, o in zip(prompts, outs):
        b.cache.poll(block=True)
        numerics.assert_same_output(o, ref.generate([p], numerics.with_logits(SP))[0], ref.model_config)
    assert b.stats()["cache"]["evicted_pages"]["L2"] > 0
    again = prompts[0] + outs[0].token_ids + [7] * 20
    first = b.cache.tree.root.children[b.cache.tree.page_keys(prompts[0][:PS])[0]]
    assert first.l1["full"] is None and first.l2["full"] is None and first.l3["full"]   # an L3-only node
    got = b.generate([again], SP)[0]
    numerics.assert_same_output(got, ref.generate([again], numerics.with_logits(SP))[0], ref.model_config)
    assert got.cached_tokens_by_tier["L3"] > 0, got.cached_tokens_by_tier
    b.check_integrity()
    _done(b)


@pytest.mark.numerics
def test_prefetch_starts_while_queued_behind_others(written, l3dir, ref):
    """With the running batch full, the queued request's L3 read starts at once, not when it reaches
    the head: by the time the other finishes its pages are in L2 and it starts without waiting."""
    _, prompt, turn2, want = written
    b = Engine.from_pretrained("strata-tiny", page_size=PS, num_pages=256, enable_prefix_cache=True,
                               poison_kv=True, max_running_requests=1,
                               hicache=HiCacheConfig(host_pages=256, l3=L3Config(
                                   backend="file", path=str(l3dir), prefetch_policy="wait_complete")))
    other = b.add_request([(7 * i) % 256 for i in range(40)], SamplingParams(max_new_tokens=6, ignore_eos=True))
    while b.requests[other].status is not Status.RUNNING:
        b.step()
    r = b.add_request(turn2, SP)
    b.step()
    assert b.requests[r].status is Status.WAITING   # behind the full batch, its read already under way
    # Only its read: the 40-token one is shorter than prefetch_min_tokens and never looked in L3.
    assert b.requests[r].prefetch is not None and b.cache.l3.prefetcher.stats["started"] == 1
    while b.requests[r].status is not Status.FINISHED:
        b.step()
        b.check_integrity()
    out = b.pop_finished(r)
    numerics.assert_same_output(out, want, ref.model_config)
    assert out.cached_tokens_by_tier["L3"] == PS * (len(prompt) // PS)
    _done(b)


class HeldFileStore(FileStore):
    """The real file store, with reads of the ``held`` keys kept waiting until the test opens the gate;
    ``blocked`` tells the test that the reader reached them (everything before has arrived)."""

    def __init__(self, cfg, held: set[str], gate: threading.Event, blocked: threading.Event) -> None:
        super().__init__(cfg)
        self.held, self.gate, self.blocked = held, gate, blocked

    def _get(self, keys, pages):
        if self.held.intersection(keys):
            self.blocked.set()
            self.gate.wait(120)
        return super()._get(keys, pages)


@pytest.fixture(scope="module")
def two_sequences(tmp_path_factory, ref):
    """Engine A served a 20-page prompt, then a longer second turn: L3 holds the last window of each
    (SWA pages 16..19 and the second turn's). The third turn, and its tokens."""
    root = tmp_path_factory.mktemp("l3two")
    a = _engine(root)
    g = torch.Generator().manual_seed(5)
    p1 = torch.randint(0, 256, (20 * PS,), generator=g).tolist()
    p2 = p1 + a.generate([p1], SP)[0].token_ids + torch.randint(0, 256, (6 * PS,), generator=g).tolist()
    turn3 = p2 + a.generate([p2], SP)[0].token_ids + [9] * 10
    a.cache.poll(block=True)
    a.close()
    return root, turn3, ref.generate([turn3], numerics.with_logits(SP))[0]


@pytest.mark.numerics
def test_partial_prefetch_takes_the_longest_prefix_whose_window_arrived(two_sequences, tmp_path, ref):
    """Hybrid model, slow store: the reads past page 20 hang, the timeout passes, and the request takes
    the first 20 pages from L3 -- their own last window arrived -- instead of nothing."""
    shutil.copytree(two_sequences[0], tmp_path / "l3")
    _, turn3, want = two_sequences
    b = _engine(tmp_path / "l3", prefetch_policy="timeout", prefetch_timeout_base=600.0, prefetch_batch_pages=4)
    keys = b.cache.tree.page_keys(turn3)
    tier = b.cache.l3
    assert tier.store.batch_exists(tier.keys(keys[16:20], "swa")) == 4    # the first sequence's window
    gate, blocked = threading.Event(), threading.Event()
    tier.store.close()
    tier.store = HeldFileStore(tier.store.cfg, set(tier.keys(keys[20:], "full")), gate, blocked)
    clock = [0.0]
    b.hooks.wall_clock = lambda: clock[0]
    r = b.add_request(turn3, SP)
    for _ in range(10_000):
        if blocked.wait(0.001):
            break
        b.step()
    assert blocked.is_set() and b.requests[r].status is Status.WAITING
    clock[0] = 1e9                                        # the deadline passes with pages 0..19 arrived
    while b.requests[r].status is not Status.FINISHED:
        b.step()
    out = b.pop_finished(r)
    gate.set()
    numerics.assert_same_output(out, want, ref.model_config)
    assert out.cached_tokens_by_tier == {"L1": 0, "L2": 0, "L3": 20 * PS}
    _done(b)


@pytest.mark.numerics
def test_corrupt_page_past_a_window_keeps_the_prefix_before_it(two_sequences, tmp_path, ref):
    """A corrupt full page 22 ends the reads; the 20 pages before it have their window: they are used."""
    shutil.copytree(two_sequences[0], tmp_path / "l3")
    _, turn3, want = two_sequences
    b = _engine(tmp_path / "l3", prefetch_batch_pages=4)
    _flip_a_byte(b, tmp_path / "l3", b.cache.tree.page_keys(turn3)[22])
    got = b.generate([turn3], SP)[0]
    numerics.assert_same_output(got, want, ref.model_config)
    assert got.cached_tokens_by_tier == {"L1": 0, "L2": 0, "L3": 20 * PS}
    assert b.cache.l3.store.stats()["corrupt"] == 1
    _done(b)
