"""Shared prefixes on a sliding-window model ([branch]): the sliding KV of a prompt's interior is cached,
not discarded, so a prompt branching off inside a cached one (a shared system prompt, a few-shot prefix,
a fork, an edit, a truncation) finds the window before its branch point; SWA-pool pressure takes
interior pages before the windows the tree keeps (sequence ends, branch points, message boundaries,
checkpoints), and a request never waits for SWA room eviction could give."""
import dataclasses

import pytest
import torch

from engine import Engine, SamplingParams
from storage.pools import FULL, SWA
from storage.radix import L1, RadixTree
from tests import numerics

PS, W = 4, 2   # tree tests: pages of 4 tokens, a window of 2 pages


def _keys(t: RadixTree, n: int, base: int = 0):
    return t.page_keys(list(range(base, base + n * PS)))


def _kept(t: RadixTree) -> set[int]:
    """Pages of the tree's SWA data flagged as kept windows."""
    out, stack = set(), [t.root]
    while stack:
        x = stack.pop()
        stack.extend(x.children.values())
        if x is not t.root and x.swa_keep:
            out.update(range(x.depth, x.end))
    return out


def test_tree_keeps_the_windows_before_ends_checkpoints_and_branch_points():
    t = RadixTree(PS, W)
    k = _keys(t, 12)
    t.insert(k, list(range(12)), list(range(12)), now=1, checkpoints=[6])
    t.check_integrity()
    assert _kept(t) == {4, 5, 10, 11}                      # before the checkpoint at 6 and the end at 12
    b = k[:8] + _keys(t, 2, base=1000)                     # branches off at page 8, inside the first sequence
    t.insert(b, list(range(8)) + [20, 21], list(range(8)) + [20, 21], now=2)
    t.check_integrity()
    assert _kept(t) == {4, 5, 6, 7, 8, 9, 10, 11}          # + the branch point's window and the new end's
    # Pressure: interior pages go first (A's 0-3 and 8-9), then the kept windows, least recent first.
    freed = t.evict(SWA, L1, 6)
    assert sorted(freed[SWA, L1]) == [0, 1, 2, 3, 8, 9]
    assert len(t.evict(SWA, L1, 4, spare_kept=True)[SWA, L1]) == 0   # room for interior pages only from interior
    t.check_integrity()
    assert t.match_prefix(k[:8], now=3).num_pages == 8     # the branch point still has its window
    assert t.match_prefix(k, now=3).num_pages == 12        # so has A's end
    assert t.match_prefix(k[:6] + _keys(t, 1, base=2000), now=3).num_pages == 6   # so has the checkpoint
    freed = t.evict(SWA, L1, 100)
    assert len(freed[SWA, L1]) == 8 and not _kept(t)       # tombstones keep nothing
    t.check_integrity()


def test_a_chunked_insert_keeps_no_window_at_its_chunk_ends():
    t = RadixTree(PS, W)
    k = _keys(t, 8)
    t.insert(k[:4], list(range(4)), list(range(4)), now=1, keep_end=False)
    assert not _kept(t)
    t.insert(k, list(range(8)), list(range(8)), now=2)
    assert _kept(t) == {6, 7}
    t.check_integrity()


# ---- the engine (strata-tiny: window 64, page 16) ------------------------------------------------------

SP = SamplingParams(max_new_tokens=8, ignore_eos=True, return_logits=True)


def _rand(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(0, 256, (n,), generator=g).tolist()


def _run(eng: Engine, prompt: list[int], boundaries=()):
    rid = eng.add_request(prompt, dataclasses.replace(SP, message_boundaries=tuple(boundaries)))
    while eng.has_unfinished():
        eng.step()
        eng.check_integrity()
    return eng.pop_finished(rid)


@pytest.fixture(scope="module")
def reference():
    e = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=512)
    yield e
    e.close()


@pytest.mark.numerics
@pytest.mark.parametrize("swa_full_ratio", [0.5, 26 / 2048])   # the default pool; 26 SWA pages (< P's 37)
def test_the_abcd_probe_hits_from_every_branch_point(reference, swa_full_ratio):
    """The issue's probe: P of 600 tokens; A = P + 20 (cold), B = P + 20 others, C = P + 200 others,
    D = P[:300] + 20. B and C hit |P| less its partial page; D hits its 300 tokens' whole pages with
    the default pool, and at least the 256-token checkpoint with a pool too small for P's interior."""
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=2048, enable_prefix_cache=True,
                                 swa_full_ratio=swa_full_ratio, poison_kv=True)
    g = torch.Generator().manual_seed(33)
    p = _rand(600, g)
    probes = {"A": p + _rand(20, g), "B": p + _rand(20, g), "C": p + _rand(200, g), "D": p[:300] + _rand(20, g)}
    got = {name: _run(eng, prompt) for name, prompt in probes.items()}
    hits = {name: o.cached_tokens for name, o in got.items()}
    assert hits["A"] == 0
    assert hits["B"] >= 600 - 16 and hits["C"] >= 600 - 16, hits
    assert hits["D"] >= (288 if swa_full_ratio == 0.5 else 256), hits
    if swa_full_ratio < 0.5:
        assert eng.pools.swa.num_pages < 600 // 16
    for name, prompt in probes.items():
        want = reference.generate([prompt], SP)[0]
        numerics.assert_same_output(got[name], want, eng.model_config, f"probe {name}")
    eng.close()


def test_message_boundaries_keep_their_window_under_pressure():
    """A boundary given at admission (the chat template's message ends) keeps the window before it: an
    edit of the message after it hits up to the boundary, even with checkpoints far apart and a pool
    that holds little more than one prompt's windows."""
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=2048, enable_prefix_cache=True,
                                 swa_full_ratio=20 / 2048, swa_checkpoint_interval=4096)
    g = torch.Generator().manual_seed(5)
    system, first = _rand(200, g), _rand(300, g)
    _run(eng, system + first, boundaries=[200])
    _run(eng, _rand(150, g))   # other traffic: its pages evict the first prompt's interior
    assert eng.cache.stats["evicted_pages"]["L1"] > 0
    edit = _run(eng, system + _rand(50, g))
    assert edit.cached_tokens == 192, edit.cached_tokens   # the whole pages before the boundary at 200
    eng.check_integrity()
    with pytest.raises(ValueError, match="message_boundaries"):
        eng.add_request(system, dataclasses.replace(SP, message_boundaries=(500,)))
    with pytest.raises(ValueError, match="message_boundaries"):
        SamplingParams(message_boundaries=(0,))
    eng.close()


def test_swa_pressure_evicts_interior_first_and_no_request_waits_for_room():
    """A pool smaller than the working set: every request still runs at once (eviction gives it room),
    interior pages go before kept windows, and the shared system prompt keeps hitting."""
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=1024, enable_prefix_cache=True,
                                 swa_full_ratio=24 / 1024)
    g = torch.Generator().manual_seed(9)
    system = _rand(384, g)
    hits = []
    for i in range(8):
        rid = eng.add_request(system + _rand(64, g), SP)
        eng.step()
        assert eng.requests[rid].num_computed > 0, "waited for SWA room"
        while eng.has_unfinished():
            eng.step()
            eng.check_integrity()
        hits.append(eng.pop_finished(rid).cached_tokens)
        tree = eng.cache.tree
        interior = sum(len(n.l1_swa) for n in tree.iter_nodes() if n.l1_swa is not None and not n.swa_keep)
        kept = sum(len(n.l1_swa) for n in tree.iter_nodes() if n.l1_swa is not None and n.swa_keep)
        # Kept windows are never evicted while interior pages remain (pool full: free + interior >= 0)
        assert kept + interior <= eng.pools.swa.num_pages
    assert hits[0] == 0 and all(h == 384 for h in hits[1:]), hits
    assert eng.scheduler.num_preemptions == 0
    eng.close()



def test_the_chat_route_keeps_the_window_before_each_message_end():
    """Through the OpenAI chat route (openai SDK over the in-process app): the rendered conversation's
    message ends become kept windows, so an edit of the last user message hits up to the end of the
    message before it, even with checkpoints far apart and the interior evicted by other traffic."""
    import openai
    from fastapi.testclient import TestClient

    from actors.http_api import build_app
    from actors.local_backend import LocalBackend

    backend = LocalBackend.from_pretrained("strata-tiny", page_size=16, num_pages=2048, enable_prefix_cache=True,
                                           swa_full_ratio=24 / 2048, swa_checkpoint_interval=4096)
    eng = backend.core.engine
    with TestClient(build_app(backend)) as http:
        oai = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        system = {"role": "system", "content": "You answer in one short sentence, plainly. " * 12}
        history = [system, {"role": "user", "content": "What is the tallest mountain on the island?"},
                   {"role": "assistant", "content": "It is the one to the north."}]
        ask = lambda last: oai.chat.completions.create(   # noqa: E731
            model="strata-tiny", messages=history + [{"role": "user", "content": last}], max_tokens=4)
        ask("And how high is it, in metres and in feet?")
        ids = eng.tokenizer.encode(eng.tokenizer.render_chat(history, add_generation_prompt=False))
        oai.completions.create(model="strata-tiny", prompt=[7] * 300, max_tokens=4)   # evicts interior pages
        assert eng.cache.stats["evicted_pages"]["L1"] > 0
        edit = ask("How far is it from the coast?")
        assert edit.usage.prompt_tokens_details.cached_tokens == len(ids) // 16 * 16
    backend.close()


@pytest.mark.numerics
def test_a_branch_point_found_only_in_l2_loads_its_window_and_full_pages(reference):
    """L2 holds the kept windows (checkpoints, ends), not the interior: with L1 emptied, B and D hit
    from L2 up to their last checkpoint, load-back moves no more than they use, tokens as without cache."""
    from storage.config import HiCacheConfig
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=2048, enable_prefix_cache=True,
                                 hicache=HiCacheConfig(host_pages=2048, write_policy="write_through"))
    g = torch.Generator().manual_seed(34)
    p = _rand(600, g)
    _run(eng, p + _rand(20, g))
    for name, prompt, want in (("B", p + _rand(20, g), 512), ("D", p[:300] + _rand(20, g), 256)):
        eng.cache.poll(block=True)
        for c in ("full", "swa"):
            eng.cache.evict_l1(c, 1 << 30)    # only L2 holds the cached pages now
        before = dict(eng.stats()["cache"]["loadback"])
        out = _run(eng, prompt)
        assert out.cached_tokens == want and out.cached_tokens_by_tier["L2"] == want, (name, out.cached_tokens_by_tier)
        lb = eng.stats()["cache"]["loadback"]
        loaded, used = lb["loaded"] - before["loaded"], lb["used"] - before["used"]
        assert 0 < loaded <= 1.05 * used, (name, loaded, used)
        numerics.assert_same_output(out, reference.generate([prompt], SP)[0], eng.model_config, name)
    eng.check_integrity()
    eng.close()


@pytest.mark.numerics
def test_a_branch_point_found_only_in_l3_loads_its_window_and_full_pages(reference, tmp_path):
    """L3 holds the same kept windows as L2: with L1 and L2 emptied, B and D are prefetched from L3 up to
    their last checkpoint, tokens as without cache."""
    from storage.config import HiCacheConfig
    from storage.l3.config import L3Config
    hc = HiCacheConfig(host_pages=2048, write_policy="write_through",
                       l3=L3Config(backend="file", path=str(tmp_path), prefetch_policy="wait_complete"))
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=2048, enable_prefix_cache=True, hicache=hc)
    g = torch.Generator().manual_seed(35)
    p = _rand(600, g)
    _run(eng, p + _rand(20, g))
    for name, prompt, want in (("B", p + _rand(20, g), 512), ("D", p[:300] + _rand(20, g), 256)):
        eng.cache.poll(block=True)
        eng.flush_cache()                      # L1, L2 and the tree: only the L3 store keeps the pages
        out = _run(eng, prompt)
        assert out.cached_tokens == want and out.cached_tokens_by_tier["L3"] == want, (name, out.cached_tokens_by_tier)
        numerics.assert_same_output(out, reference.generate([prompt], SP)[0], eng.model_config, name)
    eng.check_integrity()
    eng.close()


def test_decode_still_frees_what_slides_out_of_the_window():
    """Only prompt chunks keep interior pages: a long decode holds no more than swa_pages_bound SWA pages
    of its own between steps, and none as interior."""
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=1024, enable_prefix_cache=True)
    g = torch.Generator().manual_seed(36)
    rid = eng.add_request(_rand(100, g), SamplingParams(max_new_tokens=200, ignore_eos=True))
    bound, steps = eng.geometry.swa_pages_bound, 0
    while eng.has_unfinished():
        eng.step()
        req = eng.requests[rid]
        if req.output_ids and eng.kv.holds(req):
            steps += 1
            assert not req.pages.interior and len(req.pages.owned_swa()) <= bound, (len(req.output_ids), req.pages)
    assert steps > 150
    eng.close()
