"""NoCache (storage/hicache/no_cache.py): an engine without a prefix cache calls its cache like any other
and answers what it always answered without one (stats, flush, events, integrity), so nothing above the
cache asks whether there is one."""
import re
from pathlib import Path

from engine import Engine, SamplingParams
from engine.scheduler import SchedulerHooks
from storage.hicache import HiCache, NoCache

ROOT = Path(__file__).resolve().parents[2]
SP = SamplingParams(max_new_tokens=4, ignore_eos=True)


def test_an_engine_without_prefix_cache_has_a_nocache_that_answers_as_before():
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=32)
    assert type(eng.cache) is NoCache and type(eng.hooks) is SchedulerHooks and not eng.kv.page_aligned
    prompt = list(range(40))
    first = eng.generate(prompt, SP)[0]
    again = eng.generate(prompt, SP)[0]
    assert first.token_ids == again.token_ids and again.cached_tokens == 0
    assert again.cached_tokens_by_tier == {"L1": 0, "L2": 0, "L3": 0}
    eng.check_integrity()
    assert eng.pools.all_free()
    assert "cache" not in eng.stats()
    assert eng.cache.take_events() == []
    assert eng.flush_cache() == {"L1": {}, "L2": {}, "L3": {}, "L3_store": None}
    assert eng.flush_cache(l3=True) == {"L1": {}, "L2": {}, "L3": {}, "L3_store": None}
    eng.close()


def test_an_engine_with_prefix_cache_reports_its_cache():
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=32, enable_prefix_cache=True)
    assert type(eng.cache) is HiCache and eng.kv.page_aligned
    eng.generate(list(range(40)), SP)
    assert set(eng.stats()["cache"]) >= {"hit_tokens", "usage"}
    assert eng.cache.take_events()   # the tree told of what it stored
    eng.close()


def test_nothing_above_the_cache_asks_whether_there_is_one():
    """Past construction: no ``cache is None`` / ``cache is not None`` on a cache object in engine/ or
    actors/ (what the config says, ``cfg.hicache``, is another question: whether L2 is configured)."""
    pat = re.compile(r"cache is None|cache is not None|\.cache if|cache else")
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for room in ("engine", "actors") for p in sorted((ROOT / room).rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if pat.search(line) and "hicache" not in line and "enable_prefix_cache" not in line]
    assert hits == []
