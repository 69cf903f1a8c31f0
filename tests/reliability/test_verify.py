"""The soak's judge (``judge.verify``) on an offline engine, no cluster: a right answer passes, a wrong
token fails, and a departure is excused only where it is a near-tie the reference then continues."""
import random

import pytest

from engine import Engine, SamplingParams
from tests import numerics
from tests.reliability.judge import explain_by_routing_tie, explain_by_ties, explain_text_by_ties, verify
from tests.reliability.workload import ABORTED, OK, Outcome, Recorder
from tests.routing_probe import RouterProbe

pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def ref():
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=512, enable_prefix_cache=True)
    yield eng
    eng.close()


def _outcome(prompt, tokens, max_new, kind=OK):
    return Outcome(kind, "/generate", True, prompt, max_new, tokens, 0.0, 1.0)


def _prompt(seed, n=70):
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _answer(ref, prompt, n):
    return ref.generate([prompt], SamplingParams(max_new_tokens=n, temperature=0.0, return_logits=True))[0]


def _flip_at(ref, prompt, n, at):
    """The reference's answer, its token ``at`` replaced by the runner-up, then continued greedily by the
    reference: what a cluster that broke a tie the other way would answer. Also the reference's gap there
    and how far two computations of that gap may be apart (twice the policy's logit tolerance)."""
    out = _answer(ref, prompt, n)
    lg = out.logits[at].float()
    second = int(lg.topk(2).indices[1])
    head = out.token_ids[:at] + [second]
    rest = _answer(ref, prompt + head, n - at - 1).token_ids if n - at - 1 else []
    noise = 2 * numerics.logit_tolerance(ref.model_config, len(prompt) + at, numerics.magnitude(lg))
    return head + rest, float(lg.max() - lg[second]), noise


def test_right_answers_pass_wrong_ones_fail(ref):
    p1, p2 = _prompt(1), _prompt(2)
    good = _answer(ref, p1, 8).token_ids
    other = _answer(ref, p2, 8).token_ids
    bad = good[:3] + [(good[3] + 1) % 256] + good[4:]
    rec = Recorder([_outcome(p1, good, 8), _outcome(p2, other[:2], 8, ABORTED), _outcome(p1, bad, 8),
                    _outcome(p2, good, 8)])
    v = verify(rec, ref)
    assert v["checked"] == 4
    assert [w["got"] for w in v["wrong"]] == [bad[:16], good[:16]]
    first_diff = next(i for i, (a, b) in enumerate(zip(good, other)) if a != b)
    assert [w["near_ties"][0]["at"] for w in v["wrong"]] == [3, first_diff]
    assert not any(w["explained"] for w in v["wrong"])
    assert v["near_ties"] == []


def test_a_departure_is_excused_only_at_a_near_tie(ref):
    p = _prompt(3)
    flipped, gap, noise = _flip_at(ref, p, 10, 4)
    assert gap > noise      # an ordinary token: its margin is a property of the model, not of rounding
    o = _outcome(p, flipped, 10)
    # With a tolerance above the gap it is a tie broken the other way, then the reference's own path.
    ok = explain_by_ties(ref, o, tol=gap + noise)
    assert ok["explained"] and [t["at"] for t in ok["near_ties"]] == [4]
    assert abs(ok["near_ties"][0]["ref_margin"] - gap) <= noise
    # The same departure with a tolerance below its gap is wrong tokens.
    assert not explain_by_ties(ref, o, tol=gap - noise)["explained"]
    # A tie excused, but a later token that is not the reference's continuation is still caught.
    broken = flipped[:7] + [(flipped[7] + 1) % 256] + flipped[8:]
    res = explain_by_ties(ref, _outcome(p, broken, 10), tol=gap + noise)
    assert not res["explained"] and [t["at"] for t in res["near_ties"]] == [4, 7]
    # An aborted stream: the excused prefix is enough.
    assert explain_by_ties(ref, _outcome(p, flipped[:6], 10, ABORTED), tol=gap + noise)["explained"]


def _text(ref, prompt, tokens, max_new, kind=OK):
    """The same answer as /v1/completions returns it: text, no token ids."""
    return Outcome(kind, "/v1/completions", False, prompt, max_new, [], 0.0, 1.0,
                   text=ref.tokenizer.decode(tokens))


def test_a_text_answer_departing_at_a_near_tie_is_excused_only_there(ref):
    # The same departure as above, seen as text: the judge rebuilds the token path the text implies.
    p = _prompt(3)
    flipped, gap, noise = _flip_at(ref, p, 10, 4)
    assert gap > noise
    ok = explain_text_by_ties(ref, _text(ref, p, flipped, 10), tol=gap + noise)
    assert ok["explained"] and [t["at"] for t in ok["near_ties"]] == [4], ok
    assert not explain_text_by_ties(ref, _text(ref, p, flipped, 10), tol=gap - noise)["explained"]
    # A later token that is not the reference's continuation is still caught (an ASCII letter: another
    # byte could render as the same replacement character as the one it replaces).
    broken = flipped[:7] + [65 if flipped[7] != 65 else 66] + flipped[8:]
    assert ref.tokenizer.decode(broken) != ref.tokenizer.decode(flipped)
    res = explain_text_by_ties(ref, _text(ref, p, broken, 10), tol=gap + noise)
    assert not res["explained"] and [t["at"] for t in res["near_ties"]][:1] == [4], res
    # Through verify, with the default tolerance: an ordinary token's margin is no tie, so it is wrong.
    res = verify(Recorder([_text(ref, p, flipped, 10)]), ref)
    assert len(res["wrong"]) == 1 and res["near_ties"] == [] and not res["wrong"][0]["explained"]
    # An aborted stream whose text is a prefix of the excused answer passes too.
    cut = _text(ref, p, flipped[:6], 10, ABORTED)
    assert explain_text_by_ties(ref, cut, tol=gap + noise)["explained"]


def test_the_default_tolerance_excuses_no_ordinary_token(ref):
    # The default tolerance (the policy's logit tolerance) sits between the logit noise of two correct
    # computations and the gaps greedy decoding sees on this model: flipping a typical token is caught.
    p = _prompt(4)
    flipped, gap, noise = _flip_at(ref, p, 8, 2)
    assert gap > noise
    res = verify(Recorder([_outcome(p, flipped, 8)]), ref)
    assert len(res["wrong"]) == 1 and res["near_ties"] == []
    assert res["wrong"][0]["near_ties"][0]["ref_margin"] > res["wrong"][0]["near_ties"][0]["tolerance"]


def test_a_departure_after_a_routing_tie_is_excused_only_if_that_tie_explains_it(ref):
    # A soak turn whose top-k routing at layer 1, position 573 is a near-tie (~1e-6): a cluster whose
    # rounding (chunked prefill, another batch) broke it the other way departs from the one-step reference
    # at the 9th token. That cluster is built here by breaking the tie on purpose, so on every CPU; the
    # judge finds the tie and reproduces the answer by swapping that one decision.
    from tests.unit.test_chunked_prefill_routing_tie import PROMPT as prompt, TIE
    one_step = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=512, max_batch_tokens=4096)
    sp = SamplingParams(max_new_tokens=15, temperature=0.0)
    want = one_step.generate([prompt], sp)[0].token_ids
    with RouterProbe(one_step, flip=TIE) as probe:
        got = one_step.generate([prompt], sp)[0].token_ids
    assert probe.flipped and got != want
    # The judge excuses it. Which excuse it finds first depends on this CPU's rounding: where the departing
    # token is also within the logit tolerance of the reference's top logit, the near-tie of the logits
    # (tried first) explains it; elsewhere only the routing tie does. Either way nothing is wrong.
    v = verify(Recorder([_outcome(prompt, got, 15)]), one_step)
    assert v["wrong"] == [] and len(v["near_ties"]) == 1 and v["near_ties"][0]["explained"]
    # The routing-tie excuse itself, on every CPU: it finds that tie and reproduces the answer by swapping
    # that one decision (not by the reference breaking a tie on its own).
    rt = explain_by_routing_tie(one_step, _outcome(prompt, got, 15))
    assert rt["explained"], rt
    tie = rt["routing_tie"]
    assert (tie["layer"], tie["position"]) == TIE and tie["step"] == 0 and "broken_by" not in tie
    # Another departure on the same prompt is excused by neither.
    bad = got[:3] + [(got[3] + 1) % 256] + got[4:]
    v = verify(Recorder([_outcome(prompt, bad, 15)]), one_step)
    assert len(v["wrong"]) == 1 and not v["wrong"][0]["explained"]
    assert not explain_by_routing_tie(one_step, _outcome(prompt, bad, 15))["explained"]


def _routing_runs(eng, prompt, n, flip=None):
    """Greedy answer of ``eng`` with every router decision recorded, and the one at ``flip`` = (layer,
    position) given its (k+1)-th expert instead of its k-th."""
    with RouterProbe(eng, flip) as probe:
        return eng.generate([prompt], SamplingParams(max_new_tokens=n, temperature=0.0))[0].token_ids, probe


def test_a_routing_tie_in_a_decode_step_is_found_and_only_that_one_excuses(ref):
    one_step = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=512, max_batch_tokens=4096)
    p = _prompt(5, 40)
    want, probe = _routing_runs(one_step, p, 12)
    # The closest decode-step decision whose other choice changes the answer: a cluster whose noise broke
    # it. Which one that is may depend on the CPU (gaps move by rounding noise); that one exists does not:
    # a swapped expert moves that token's hidden state far beyond noise, and greedy decoding follows.
    d = got = None
    for cand in probe.closest(len(probe.decisions), min_step=1):
        out, _ = _routing_runs(one_step, p, 12, flip=(cand.layer, cand.position))
        if out != want:
            d, got = cand, out
            break
    assert d is not None, "no decode-step routing decision changes this answer"
    o = _outcome(p, got, 12)
    # The judge recomputes the same decisions (same engine, same shapes: the same bits), so a tolerance
    # just above or below this gap includes or excludes exactly this decision.
    res = explain_by_routing_tie(one_step, o, tol=d.gap * (1 + 1e-4),
                                max_tries=len(probe.decisions))
    assert res["explained"] and (res["routing_tie"]["step"], res["routing_tie"]["layer"]) == (d.step, d.layer)
    below = explain_by_routing_tie(one_step, o, tol=d.gap * (1 - 1e-4),
                                  max_tries=len(probe.decisions))
    assert below is None or not below["explained"]
