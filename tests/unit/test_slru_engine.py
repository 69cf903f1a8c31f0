"""Segmented LRU (`prefix_eviction: slru`) through the Engine: conversations that come back in turn, with
an L1 too small for all of them. Plain LRU evicts each conversation whole just before it is due; SLRU
evicts each one's never-reused newest turn first, so every conversation keeps its older prefix. The
tokens are the same either way (eviction only decides what is recomputed)."""
import pytest
import torch

from engine import Engine, SamplingParams
from engine.config import EngineConfig
from tests import numerics

pytestmark = pytest.mark.numerics   # the two policies' tokens are compared


def _conversations(n: int, rounds: int, first: int, add: int) -> list[list[list[int]]]:
    g = torch.Generator().manual_seed(3)
    return [[torch.randint(0, 256, (first if r == 0 else add,), generator=g).tolist() for r in range(rounds)]
            for _ in range(n)]


def _serve(eviction: str, convs) -> tuple[list, int, object]:
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=72, enable_prefix_cache=True,
                                 prefix_eviction=eviction)
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True, return_logits=True)
    history = [[] for _ in convs]
    outs, cached = [], 0
    try:
        for r in range(len(convs[0])):
            for c, turns in enumerate(convs):
                history[c] = history[c] + turns[r]
                rid = eng.add_request(history[c], sp)
                while eng.has_unfinished():
                    eng.step()
                eng.check_integrity()
                out = eng.pop_finished(rid)   # the next turn extends the prompt alone, so both policies
                outs.append(out)              # see the same prompts even after a near-tie departure
                cached += out.cached_tokens
        mc = eng.model_config
    finally:
        eng.close()
    return outs, cached, mc


def test_slru_keeps_every_conversations_older_prefix_where_lru_loses_whole_ones():
    convs = _conversations(6, 4, first=160, add=48)
    lru, lru_cached, mc = _serve("lru", convs)
    slru, slru_cached, _ = _serve("slru", convs)
    numerics.assert_same_outputs(slru, lru, mc, "slru vs lru")
    assert slru_cached > 1.2 * lru_cached, (slru_cached, lru_cached)


def test_prefix_eviction_is_validated():
    with pytest.raises(ValueError, match="prefix_eviction"):
        EngineConfig(prefix_eviction="mru")
