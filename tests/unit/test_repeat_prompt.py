"""A repeated prompt (retry, regeneration, n>1 arriving separately) is served from the prefix cache up to
its last whole page before its last token, whatever its length modulo the page size and however long
the first request decoded (issue #22: 608 tokens at page 16 used to get 0 cached tokens every time)."""
import pytest
import torch

from engine import Engine, SamplingParams
from tests import numerics

pytestmark = pytest.mark.numerics   # the repeats' tokens are compared with the first run's


@pytest.fixture(scope="module")
def eng():
    e = Engine.from_pretrained("strata-tiny", page_size=16, enable_prefix_cache=True)
    yield e
    e.close()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _drain(eng, rids):
    while eng.has_unfinished():
        eng.step()
        eng.check_integrity()
    return [eng.pop_finished(r) for r in rids]


# 608 and 592 end on a page boundary, 609 and 593 one token past it, 600 and 607 inside a page.
@pytest.mark.parametrize("length", [608, 609, 600, 592, 593, 607])
@pytest.mark.parametrize("new_tokens", [8, 40])   # 40: decode slides the window past the prompt's end
def test_repeat_is_served_up_to_its_last_cacheable_page(eng, length, new_tokens):
    ps = eng.geometry.page_size
    eng.flush_cache()
    prompt = _prompt(length, seed=length * 100 + new_tokens)
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, return_logits=True)
    outs = [_drain(eng, [eng.add_request(prompt, sp)])[0] for _ in range(3)]
    want = eng.geometry.cacheable_tokens(length)
    assert want >= length - ps - 1
    assert [o.cached_tokens for o in outs] == [0, want, want]
    for o in outs[1:]:
        numerics.assert_same_output(o, outs[0], eng.model_config, f"repeat of {length}")
    eng.flush_cache()
    eng.check_integrity()
    assert eng.pools.all_free()


def test_second_sample_arriving_while_the_first_decodes_hits(eng):
    """n>1 arriving separately: the prompt is cached as soon as it is prefilled, not when the first
    request finishes."""
    eng.flush_cache()
    prompt = _prompt(608, seed=7)
    sp = SamplingParams(max_new_tokens=30, ignore_eos=True, return_logits=True)
    first = eng.add_request(prompt, sp)
    while not eng.requests[first].output_ids:
        eng.step()
        eng.check_integrity()
    second = eng.add_request(prompt, sp)
    a, b = _drain(eng, [first, second])
    assert (a.cached_tokens, b.cached_tokens) == (0, eng.geometry.cacheable_tokens(608))
    numerics.assert_same_output(b, a, eng.model_config, "second sample")
    eng.flush_cache()
    eng.check_integrity()
    assert eng.pools.all_free()
