"""What clients strata did not write trip on (issue 34), through the official ``openai`` client (httpx for
vLLM's /tokenize, which the SDK has no method for) against the real HTTP app over one in-process engine:
logprob token names and offsets, prompt-logprob ranks, OpenAI's 400 error object, /tokenize and
/detokenize."""
import openai
import pytest
import torch

from engine import SamplingParams
from tests import numerics
from tests.unit.app_fixtures import http, oai, reference  # noqa: F401  (module fixtures)

MODEL = "strata-tiny"


def _bytes_of_name(name: str) -> bytes:
    """OpenAI's spelling of a token: its text, or ``bytes:\\xNN...`` when its bytes are not UTF-8."""
    if name.startswith("bytes:"):
        hexes = name[len("bytes:"):].split("\\x")
        assert hexes[0] == "" and all(len(h) == 2 for h in hexes[1:]), name
        return bytes(int(h, 16) for h in hexes[1:])
    return name.encode()


def _ids_by_bytes(tok) -> dict[bytes, int]:
    by = {tok.token_bytes(i): i for i in range(tok.vocab_size)}
    assert len(by) == tok.vocab_size   # strata-tiny: every token's bytes are its own
    return by


def _check_offsets(text: str, names: list[str], offsets: list[int], skipped: set[str]) -> None:
    """``text_offset`` against the text the client got: offsets never go back nor past the text, a token
    that ``text`` leaves out takes no characters, and a token that is whole text is found at its offset."""
    assert len(offsets) == len(names) and offsets == sorted(offsets) and offsets[-1] <= len(text), offsets
    for i, (name, at) in enumerate(zip(names, offsets)):
        if name in skipped:
            assert (offsets[i + 1] if i + 1 < len(offsets) else len(text)) == at, (i, name, offsets)
        elif not name.startswith("bytes:"):
            assert text[at:at + len(name)] == name, (i, name, at, text)


@pytest.mark.numerics
def test_byte_tokens_keep_every_top_logprob_with_its_own_value(oai, http, reference):
    """strata-tiny's bytes 0x80-0xff each decode alone to U+FFFD: named so, they overwrote each other in
    a completions ``top_logprobs`` dict (3-5 entries of 5, and not the right values)."""
    tok, mc = http.tok, reference.model_config
    by_bytes = _ids_by_bytes(tok)
    prompt = "Ünïcödé bÿtes: "
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=5)
    lp, text = r.choices[0].logprobs, r.choices[0].text
    ids = [by_bytes[_bytes_of_name(t)] for t in lp.tokens]
    want = reference.generate([tok.encode(prompt)], SamplingParams(max_new_tokens=6, return_logits=True))[0]
    d = numerics.assert_same_logprobs(ids, lp.token_logprobs, want, mc, "byte tokens")
    steps = len(ids) if d is None else d["at"] + 1
    assert sum(sum(k.startswith("bytes:") for k in top) >= 2 for top in lp.top_logprobs[:steps]) >= 1, \
        "no step offers two byte tokens: the case is not exercised"
    for k, top in enumerate(lp.top_logprobs[:steps]):
        assert len(top) == 5, top
        ref = torch.log_softmax(want.logits[k].double(), -1)
        tol = numerics.logprob_tolerance(mc, want.prompt_tokens + k, numerics.magnitude(want.logits[k]))
        fifth = float(ref.topk(5).values[-1])
        for name, v in top.items():
            t = by_bytes[_bytes_of_name(name)]
            assert abs(v - float(ref[t])) <= tol, (k, name, v, float(ref[t]))
            assert float(ref[t]) >= fifth - tol, (k, name)   # one of the five best, up to rounding
        if ids[k] in [by_bytes[_bytes_of_name(n)] for n in top]:
            assert lp.tokens[k] in top   # the chosen token under the name ``tokens`` gives it
    _check_offsets(text, lp.tokens, lp.text_offset, set())
    c = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=4,
                                    temperature=0, logprobs=True, top_logprobs=5)
    for e in c.choices[0].logprobs.content:
        assert len({t.token for t in e.top_logprobs}) == 5 == len({bytes(t.bytes) for t in e.top_logprobs})
        assert all(_bytes_of_name(t.token) == bytes(t.bytes) for t in [e, *e.top_logprobs])


def test_text_offset_follows_the_text_the_client_got(oai, http):
    """A special token that ``text`` leaves out (skip_special_tokens) takes no characters; offsets run on
    across a stream's chunks and after an echoed prompt."""
    msg = http.tok.token_id("<|message|>")
    # Three tokens far above the rest, and a temperature that flattens the model's preference among
    # them: the seed mixes them.
    bias = {str(msg): 100, str(ord("a")): 100, str(ord("b")): 100}
    for seed in range(8):
        kw = dict(model=MODEL, prompt="xy", max_tokens=8, temperature=5.0, seed=seed, logprobs=0, logit_bias=bias)
        r = oai.completions.create(**kw).choices[0]
        names = r.logprobs.tokens
        if "<|message|>" in names and any(n != "<|message|>" for n in names[names.index("<|message|>"):]):
            break
    else:
        pytest.fail("no seed mixes <|message|> with text: the case is not exercised")
    assert "<|message|>" not in r.text
    _check_offsets(r.text, names, r.logprobs.text_offset, {"<|message|>"})
    chunks = [c.choices[0] for c in oai.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == r.text
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == r.logprobs.text_offset
    e = oai.completions.create(**kw, echo=True).choices[0]
    assert e.text == "xy" + r.text and e.logprobs.tokens == ["x", "y"] + names
    _check_offsets(e.text, e.logprobs.tokens, e.logprobs.text_offset, {"<|message|>"})


def test_prompt_logprobs_rank_the_prompt_token_over_the_vocabulary(http):
    """vLLM's ``rank`` of a prompt token is 1 + how many tokens are more likely; it was null unless the
    token was among the top-N asked for."""
    r = http.post("/v1/completions", json={"prompt": "The sea, the sky and the stars", "max_tokens": 1,
                                           "prompt_logprobs": 20}).json()
    ids = http.tok.encode("The sea, the sky and the stars")
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    outside = 0
    for tid, d in zip(ids[1:], plp[1:]):
        own = d[str(tid)]
        others = [e for k, e in d.items() if k != str(tid)]
        assert isinstance(own["rank"], int) and 1 <= own["rank"] <= http.tok.vocab_size
        # the same values in one response: ranks are exact against them
        better = sum(e["logprob"] > own["logprob"] for e in others)
        if len(d) == 20:     # the prompt token is one of the 20 best
            assert own["rank"] == better + 1, d
        else:
            outside += 1
            assert own["rank"] > 20 and better == 20, d
    assert outside, "every prompt token is in the top 20: ranks beyond it are not exercised"


@pytest.mark.parametrize("route, kw, param", [
    ("completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"n": 17}, "n"),
    ("completions", {"prompt": "x", "max_tokens": 1e9}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 8192}, "max_tokens"),     # past the context
    ("completions", {"prompt": "x", "extra_body": {"guided_regex": "(unclosed"}}, "grammar"),   # the engine's
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
])
def test_out_of_range_values_are_400_bad_request_naming_the_field(oai, route, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            oai.chat.completions.create(**{"model": MODEL, "messages": [{"role": "user", "content": "x"}], **kw})
        else:
            oai.completions.create(model=MODEL, **kw)
    err = e.value
    assert err.status_code == 400 and err.param == param and err.type == "invalid_request_error"
    assert param in err.body["message"] and set(err.body) == {"message", "type", "param", "code"}


def test_malformed_bodies_are_400_in_one_shape_and_declared(http):
    for path, raw in [("/v1/chat/completions", b'{"messages": [1, 2'), ("/v1/completions", b"null"),
                      ("/v1/completions", b"{}"), ("/tokenize", b'{"prompt": 5}')]:
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, raw, r.text)
        assert set(r.json()) == {"error"} and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert http.post("/v1/completions", json={}).json()["error"]["param"] == "prompt"
    # SGLang's route keeps SGLang's answer to a malformed body
    assert http.post("/generate", content=b"[1]", headers={"content-type": "application/json"}).status_code == 422
    doc = http.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        responses = doc["paths"][path]["post"]["responses"]
        assert "422" not in responses
        ref = responses["400"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
        body = doc["components"]["schemas"][doc["components"]["schemas"][ref]["properties"]["error"]["$ref"]
                                            .rsplit("/", 1)[-1]]
        assert {"message", "type", "param", "code"} <= set(body["required"])


def test_tokenize_and_detokenize_in_vllms_shape(oai, http):
    prompt = "Tokenize me, please: ünïcödé"
    r = http.post("/tokenize", json={"model": MODEL, "prompt": prompt, "return_token_strs": True})
    assert r.status_code == 200, r.text
    t = r.json()
    served = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage.prompt_tokens
    assert t["count"] == len(t["tokens"]) == served and t["max_model_len"] == 8192
    assert len(t["token_strs"]) == t["count"] and t["token_strs"][0] == "T"
    assert http.post("/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": prompt}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    chat = http.post("/tokenize", json={"messages": msgs}).json()
    served = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1).usage.prompt_tokens
    assert chat["count"] == served and chat["token_strs"] is None
    bare = http.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()
    assert chat["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < chat["count"]
    for path, body, param in [("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "x", "messages": msgs}, "prompt"),
                              ("/tokenize", {"messages": []}, "messages"),
                              ("/detokenize", {"tokens": [1, 10**6]}, "tokens"), ("/detokenize", {"tokens": "ab"}, "tokens")]:
        r = http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    assert http.post("/tokenize", json={"prompt": "x", "model": "gpt-9"}).status_code == 404
