"""Structured output through llguidance (engine/grammar.py) and logprobs, on strata-tiny: the output of a
random-weight model still parses and validates, logprobs are log_softmax of the logits sampled from, and
prompt logprobs score each prompt token from the logits of the position before it."""
import json
import re

import jsonschema
import pytest
import torch

from engine import Engine, SamplingParams
from engine.grammar_compile import compile_grammar
from storage.config import HiCacheConfig
from tests import numerics, pd

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def eng():
    return Engine.from_pretrained("strata-tiny", page_size=16, num_pages=256, enable_prefix_cache=True)


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 1), (1.3, 2)])
def test_json_schema_output_validates(eng, temperature, seed):
    ids = eng.tokenizer.encode("Give me a person as JSON: ")
    o = eng.generate([ids], SamplingParams(max_new_tokens=80, temperature=temperature, seed=seed,
                                           grammar=("json_schema", json.dumps(SCHEMA))))[0]
    assert o.finish_reason == "stop", o
    jsonschema.validate(json.loads(o.text), SCHEMA)


def test_regex_json_object_and_ebnf_outputs_match(eng):
    ids = eng.tokenizer.encode("code: ")
    cases = [(("regex", r"[A-Z]{2}-[0-9]{3}"), 1.0, lambda t: re.fullmatch(r"[A-Z]{2}-[0-9]{3}", t)),
             (("ebnf", 'root ::= "yes" | "no" | "maybe"'), 1.0, lambda t: t in ("yes", "no", "maybe"))]
    for g, temperature, ok in cases:
        for seed in (1, 2):
            o = eng.generate([ids], SamplingParams(max_new_tokens=40, temperature=temperature, seed=seed,
                                                   grammar=g))[0]
            assert o.finish_reason == "stop" and ok(o.text), (g, o.text)


def test_any_json_object_is_an_object_when_it_ends_and_a_prefix_of_one_when_cut(eng):
    """Any JSON object is unbounded: a random-weight model may write one long string until
    max_new_tokens (finish "length", as on any server). What it did write is still JSON so far."""
    ends = 0
    for k, seed in enumerate((None, 1, 2, 3)):
        ids = eng.tokenizer.encode(f"object {k}: ")
        o = eng.generate([ids], SamplingParams(max_new_tokens=30, temperature=0.0 if seed is None else 1.0,
                                               seed=seed, grammar=("json_object", "")))[0]
        assert o.text.startswith("{"), o.text
        if o.finish_reason == "stop":
            ends += 1
            assert isinstance(json.loads(o.text), dict)
        else:
            with pytest.raises(json.JSONDecodeError, match="Unterminated|Expecting"):
                json.loads(o.text)


def test_a_grammar_survives_prefill_on_one_engine_and_decode_on_another():
    sp = SamplingParams(max_new_tokens=60, temperature=0.8, seed=7, grammar=("json_schema", json.dumps(SCHEMA)))
    prompt = list(range(40, 70))
    pre = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=128)
    dec = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=128)
    [drid] = pd.handoff(pre, dec, [prompt], sp)
    while dec.has_unfinished():
        dec.step()
    out = dec.pop_finished(drid)
    jsonschema.validate(json.loads(dec.tokenizer.decode(out.token_ids)), SCHEMA)


def test_an_invalid_grammar_is_a_value_error_naming_it(eng):
    for g in [("regex", "(unclosed"), ("json_schema", "{not json"), ("ebnf", "root ::= undefined_rule"), ("lark", "start: ???")]:
        with pytest.raises(ValueError, match="grammar"):
            eng.add_request([1, 2, 3], SamplingParams(grammar=g))
    assert compile_grammar("regex", "a+") == compile_grammar("regex", "a+")


@pytest.mark.numerics
def test_logprobs_are_log_softmax_of_the_logits_sampled_from(eng):
    ids = list(range(10, 50))
    o = eng.generate([ids], SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=3,
                                           logprobs=True, top_logprobs=5, return_logits=True))[0]
    assert [lp.token_id for lp in o.logprobs] == o.token_ids
    mc = eng.model_config
    for lp, logits in zip(o.logprobs, o.logits):
        want = torch.log_softmax(logits.double(), -1)
        got = torch.tensor([lp.logprob] + [v for _, v in lp.top], dtype=torch.float64)
        ref = torch.cat([want[lp.token_id:lp.token_id + 1], want[[i for i, _ in lp.top]]])
        numerics.assert_close(got, ref, n=mc.vocab_size, dtype=torch.float32, what="logprobs")
        # The top 5, in order, up to float32 rounding: an alternative may trade places with another (or
        # with the 6th) only where their logprobs are within twice the tolerance of each other.
        slack = 2 * numerics.tolerance(torch.float32, mc.vocab_size, numerics.magnitude(ref))
        top = [i for i, _ in lp.top]
        assert all(float(want[a]) >= float(want[b]) - slack for a, b in zip(top, top[1:])), (top, want[top])
        rest = want.clone()
        rest[top] = float("-inf")
        assert float(rest.max()) <= min(float(want[i]) for i in top) + slack, (top, want.topk(6))


@pytest.mark.numerics
@pytest.mark.parametrize("start", [0, 17, 38])
def test_prompt_logprobs_score_each_prompt_token_from_the_position_before(eng, start):
    ids = [(7 * i) % 250 for i in range(40)]
    eng.generate([ids], SamplingParams(max_new_tokens=1))   # the prompt is cached now: logprobs must not skip it
    o = eng.generate([ids], SamplingParams(max_new_tokens=2, logprob_start_len=start, top_logprobs=2))[0]
    assert len(o.prompt_logprobs) == len(ids) - start
    if start == 0:
        assert o.prompt_logprobs[0] is None
    ref = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=64)
    for k, e in enumerate(o.prompt_logprobs):
        pos = start + k
        if pos == 0:
            continue
        logits = ref.generate([ids[:pos]], SamplingParams(max_new_tokens=1, return_logits=True))[0].logits[0]
        want = torch.log_softmax(logits.double(), -1)[ids[pos]]
        assert e.token_id == ids[pos] and len(e.top) == 2
        # A cached prompt against a fresh run of its first pos tokens: two batch shapes, the policy's rule.
        tol = numerics.logprob_tolerance(eng.model_config, pos, numerics.magnitude(logits))
        assert abs(e.logprob - float(want)) <= tol, (pos, e.logprob, float(want), tol)
        if pos > start + 3 and pos < len(ids) - 3:
            break   # a few positions at each edge of the range are enough


def test_prompt_logprobs_with_chunked_prefill_and_hicache():
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=128, enable_prefix_cache=True,
                                 max_batch_tokens=32, hicache=HiCacheConfig(host_pages=64))
    ids = [(3 * i) % 250 for i in range(100)]
    o = eng.generate([ids], SamplingParams(max_new_tokens=2, logprob_start_len=5))[0]
    assert len(o.prompt_logprobs) == 95 and all(e.token_id == ids[5 + k] for k, e in enumerate(o.prompt_logprobs))
    eng.check_integrity()


def test_without_llguidance_structured_output_is_refused_by_name_and_the_rest_serves(monkeypatch):
    """An engine where llguidance does not import (the GPU image) serves every request but structured
    output, which is a ValueError naming the package (HTTP 400), not an import error at start."""
    import engine.grammar_compile as grammar
    monkeypatch.setattr(grammar, "llguidance", None)
    monkeypatch.setattr(grammar, "_IMPORT_ERROR", ModuleNotFoundError("No module named 'llguidance'"))
    fresh = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=64)
    with pytest.raises(ValueError, match="llguidance"):
        fresh.add_request([1, 2, 3], SamplingParams(grammar=("regex", "[ab]+")))
    with pytest.raises(ValueError, match="llguidance"):
        compile_grammar.__wrapped__("regex", "[cd]+")
    assert fresh.pools.all_free()
    assert len(fresh.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))[0].token_ids) == 3


def test_the_serving_processes_do_not_import_torch_compile():
    """The worker and the ingress import the engine, grammar included, at every start and restart; torch's
    compiler (torch._dynamo, inductor: ~1.8 s of each process's start here) must not come with it."""
    import subprocess
    import sys
    code = ("import sys, actors.worker, actors.ingress, engine.grammar; print(sorted(m for m in sys.modules "
            "if m.split('.')[:2] in (['torch', '_dynamo'], ['torch', '_inductor'])))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout[-2000:]
