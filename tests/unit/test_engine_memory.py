"""SWA footprint, preemption and leak checks of the engine's scheduler over the paged pools."""
import pytest
import torch

from engine import Engine, SamplingParams
from storage.geometry import KVGeometry
from tests import numerics


def _run_checked(eng, prompts, sp):
    rids = [eng.add_request(p, sp) for p in prompts]
    while eng.has_unfinished():
        eng.step()
        eng.check_integrity()  # after every step: ownership, no leak, SWA bound
    return [eng.pop_finished(r) for r in rids]


def test_swa_peak_stays_within_window_plus_one_page_while_full_grows():
    ps, w = 16, 64
    eng = Engine.from_pretrained("strata-tiny", page_size=ps, num_pages=256, max_batch_tokens=64)
    assert eng.model_config.sliding_window == w
    n_req, prompt_len, n_new = 3, 2 * w, 2 * w   # each sequence reaches 4x the window
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (prompt_len,), generator=g).tolist() for _ in range(n_req)]
    eng.pools.full.allocator.reset_peak()
    eng.pools.swa.allocator.reset_peak()
    _run_checked(eng, prompts, SamplingParams(max_new_tokens=n_new, ignore_eos=True))
    per_req_bound = (w + ps) // ps
    assert KVGeometry(ps, w).swa_pages_bound <= per_req_bound
    assert eng.pools.swa.allocator.peak_used <= n_req * per_req_bound
    # The full pool holds every position of every sequence.
    assert eng.pools.full.allocator.peak_used >= n_req * (prompt_len + n_new - 1) // ps
    assert eng.pools.all_free()


def test_swa_footprint_of_one_long_generation_is_constant():
    eng = Engine.from_pretrained("strata-tiny", page_size=8, num_pages=256, max_batch_tokens=32)
    rid = eng.add_request(list(range(200)), SamplingParams(max_new_tokens=120, ignore_eos=True))
    swa_use, full_use = [], []
    while eng.has_unfinished():
        eng.step()
        eng.check_integrity()
        swa_use.append(eng.pools.swa.allocator.num_used)
        full_use.append(eng.pools.full.allocator.num_used)
    eng.pop_finished(rid)
    assert max(swa_use) <= KVGeometry(8, 64).swa_pages_bound <= (64 + 8) // 8
    assert max(full_use[:-1]) >= (200 + 119) // 8
    assert eng.pools.all_free()


@pytest.mark.numerics
def test_preemption_under_a_small_pool_gives_the_same_tokens():
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (60, 80, 100, 50, 70)]
    roomy = Engine.from_pretrained("strata-tiny", page_size=8, num_pages=512, max_batch_tokens=64)
    want = roomy.generate(prompts, numerics.with_logits(sp))
    tight = Engine.from_pretrained("strata-tiny", page_size=8, num_pages=24, max_batch_tokens=64)
    got = _run_checked(tight, prompts, sp)
    assert tight.scheduler.num_preemptions > 0
    numerics.assert_same_outputs(got, want, tight.model_config, "preempted")
    assert tight.pools.all_free()


def test_abort_frees_everything_mid_prefill_and_mid_decode():
    eng = Engine.from_pretrained("strata-tiny", page_size=8, num_pages=128, max_batch_tokens=16)
    a = eng.add_request(list(range(100)), SamplingParams(max_new_tokens=50, ignore_eos=True))
    b = eng.add_request(list(range(10)), SamplingParams(max_new_tokens=50, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.abort(a)
    eng.check_integrity()
    for _ in range(3):
        eng.step()
    assert eng.abort(b)
    assert not eng.abort(b)
    eng.check_integrity()
    assert eng.pools.all_free()
    assert eng.pop_finished(a).finish_reason == "abort"
