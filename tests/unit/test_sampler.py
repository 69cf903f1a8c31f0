"""The batched sampler (engine/sampler.py) against its per-row definition, and the sampling options'
effects through the engine: penalties, logit bias, min-p, min_new_tokens, stop strings, seeds."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Engine, SamplingParams
from engine.sampler import RowState, processed_logits, ref_sample_row, sample
from tests import numerics, pd

V = 40


def _state(p: SamplingParams, seed: int, prompt, out, mask=None, stop_masked=()):
    g = torch.Generator().manual_seed(seed) if not p.greedy else None
    return RowState(p, list(prompt), list(out), g, mask, tuple(stop_masked))


params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]), top_k=st.sampled_from([0, 1, 3, 50]),
    top_p=st.sampled_from([1.0, 0.9, 0.3]), min_p=st.sampled_from([0.0, 0.05, 0.5]),
    presence_penalty=st.sampled_from([0.0, 0.5, -1.0]), frequency_penalty=st.sampled_from([0.0, 0.7]),
    repetition_penalty=st.sampled_from([1.0, 1.3, 0.8]),
    logit_bias=st.sampled_from([(), ((3, 5.0),), ((0, -100.0), (7, 2.5))]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(params, st.integers(0, 1000), st.lists(st.integers(0, V - 1), max_size=6),
                          st.lists(st.integers(0, V - 1), max_size=6), st.booleans()), min_size=1, max_size=5),
       st.integers(0, 2**31))
def test_the_batch_samples_what_each_row_alone_would(rows, lseed):
    """Row by row definition vs the batched tensors: the same token for the same generator state. A
    seeded row's draw does not depend on its neighbours."""
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(lseed)) * 3
    batch, single = [], []
    for k, (p, seed, prompt, out, masked) in enumerate(rows):
        mask = None
        if masked:   # a grammar allowing every third token
            mask = torch.zeros(V, dtype=torch.bool)
            mask[k % 3::3] = True
        batch.append(_state(p, seed, prompt, out, mask, (1, 2) if masked else ()))
        single.append(_state(p, seed, prompt, out, mask, (1, 2) if masked else ()))
    toks, _ = sample(logits, batch)
    for k, s in enumerate(single):
        assert toks[k] == ref_sample_row(logits[k], s), (k, rows[k][0])
        if s.grammar_mask is not None:
            assert s.grammar_mask[toks[k]] and toks[k] not in (1, 2)


def test_penalties_and_bias_change_the_processed_logits_as_defined():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25,
                       logit_bias={2: 1.0})
    x = processed_logits(logits, [_state(p, 0, [0], [1, 1, 3])])[0]
    want = torch.tensor([2.0 / 2, -1.0 * 2 - 0.5 - 0.5, 0.5 + 1.0, 3.0 / 2 - 0.5 - 0.25])
    numerics.assert_close(x, want, n=4, what="processed logits")


def test_a_banned_token_never_comes_and_a_boosted_one_always_does():
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=128)
    ids = list(range(20, 40))
    base = eng.generate([ids], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
    banned = eng.generate([ids], SamplingParams(max_new_tokens=8, ignore_eos=True,
                                                logit_bias={t: -100.0 for t in set(base)}))[0].token_ids
    assert not set(banned) & set(base)
    boosted = eng.generate([ids], SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=3,
                                                 logit_bias={65: 100.0}))[0].token_ids
    assert boosted == [65] * 6
    rep = eng.generate([ids], SamplingParams(max_new_tokens=12, ignore_eos=True, frequency_penalty=2.0,
                                             presence_penalty=2.0))[0].token_ids
    assert len(set(rep)) > len(set(eng.generate([ids], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids)) \
        or len(set(rep)) == 12


def test_min_new_tokens_holds_back_eos_and_stop_ids():
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=128)
    ids = list(range(50, 60))
    first = eng.generate([ids], SamplingParams(max_new_tokens=3, ignore_eos=True))[0].token_ids[0]
    o = eng.generate([ids], SamplingParams(max_new_tokens=3, stop_token_ids=(first,)))[0]
    assert o.token_ids == [first] and o.finish_reason == "stop" and o.matched_stop == first
    o = eng.generate([ids], SamplingParams(max_new_tokens=5, stop_token_ids=(first,), min_new_tokens=4))[0]
    assert first not in o.token_ids[:4] and len(o.token_ids) >= 4


def test_a_stop_string_ends_generation_and_is_reported():
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=128)
    ids = eng.tokenizer.encode("the quick brown fox")
    full = eng.generate([ids], SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.0, seed=5))[0]
    stop = full.text[6:8]
    assert stop
    o = eng.generate([ids], SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.0, seed=5,
                                           stop=(stop,)))[0]
    assert o.finish_reason == "stop" and o.matched_stop == stop
    assert stop in o.text and full.text.startswith(o.text) and len(o.token_ids) < 24


@pytest.mark.numerics
def test_a_seeded_request_samples_the_same_alone_in_a_batch_and_after_prefill_elsewhere():
    sp = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.9, top_p=0.95, seed=1234)
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256)
    prompt = list(range(3, 40))
    alone = eng.generate([prompt], numerics.with_logits(sp))[0]
    others = [list(range(100, 100 + n)) for n in (5, 60)]
    mixed = eng.generate([others[0], prompt, others[1]],
                         [SamplingParams(max_new_tokens=12, temperature=1.0), sp,
                          SamplingParams(max_new_tokens=7, temperature=0.5, seed=9)])[1]
    numerics.assert_same_output(mixed, alone, eng.model_config, "in a batch")
    pre = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256)
    dec = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256)
    [drid] = pd.handoff(pre, dec, [prompt], sp)
    first = dec.requests[drid].output_ids[:1]       # the prefill engine's sample, carried by the receipt
    while dec.has_unfinished():
        dec.step()
    got = dec.pop_finished(drid)
    assert first == got.token_ids[:1]
    numerics.assert_same_output(got, alone, eng.model_config, "prefill then decode")


def test_invalid_params_name_the_field():
    for kw, field in [({"min_p": 1.5}, "min_p"), ({"presence_penalty": 3}, "presence_penalty"),
                      ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {1: 500}}, "logit_bias"),
                      ({"stop": ("",)}, "stop"), ({"top_logprobs": 21}, "top_logprobs"),
                      ({"grammar": ("yaml", "x")}, "grammar"), ({"logprob_start_len": -2}, "logprob_start_len"),
                      ({"min_new_tokens": -1}, "min_new_tokens")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=64)
    with pytest.raises(ValueError, match="logit_bias: token id 99999"):
        eng.add_request([1, 2], SamplingParams(logit_bias={99999: 1.0}))
    with pytest.raises(ValueError, match="logprob_start_len"):
        eng.add_request([1, 2], SamplingParams(logprob_start_len=2))
