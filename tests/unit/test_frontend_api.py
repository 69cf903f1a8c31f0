"""The HTTP frontend over one in-process engine (actors/local_backend.py, no Ray), driven by the official
``openai`` client and SGLang-shaped JSON: parallel samples, logprobs against the engine's own logits,
stop strings, structured output, tools, SGLang's /generate schema and the error shapes."""
import json
import re

import jsonschema
import openai
import pytest
import torch

from engine import SamplingParams
from tests import numerics
from tests.unit.app_fixtures import http, oai, reference  # noqa: F401  (module fixtures)

MODEL = "strata-tiny"
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                           "temp": {"type": "integer", "minimum": -40, "maximum": 50}},
          "required": ["city", "temp"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"enum": ["Paris", "Oslo"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                               "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
             "additionalProperties": False}}}]


def _events(resp) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_n_gives_n_choices_sharing_one_prefill(oai, http):
    msgs = [{"role": "user", "content": "Tell me something about the sea and the sky, " * 3}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, n=3, temperature=1.0, seed=11)
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.message.content for c in r.choices)
    assert len({c.message.content for c in r.choices}) > 1
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens < 200
    again = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, n=3, temperature=1.0, seed=11)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    s = oai.completions.create(model=MODEL, prompt=["abc", "xyz"], max_tokens=3, n=2, stream=True, temperature=1.0)
    done = {c.choices[0].index for c in s if c.choices and c.choices[0].finish_reason}
    assert done == {0, 1, 2, 3}


@pytest.mark.numerics
def test_logprobs_are_log_softmax_of_the_engines_logits(oai, reference):
    prompt = "The capital of France is"
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3,
                               extra_body={"return_tokens_as_token_ids": True})
    ids = reference.tokenizer.encode(prompt)
    want = reference.generate([ids], SamplingParams(max_new_tokens=5, return_logits=True))[0]
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and all(len(t) <= 3 for t in lp.top_logprobs)
    got = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    numerics.assert_same_logprobs(got, lp.token_logprobs, want, reference.model_config, "completions logprobs")
    c = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                    temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6
                                     for e in content)
    assert "".join(bytes(e.bytes).decode("latin-1") for e in content)


def test_stop_strings_never_appear_streamed_or_final(oai, http, reference):
    prompt = "Once upon a time"
    # The unstopped answer comes from the same server (another engine's batch shapes may break a
    # near-tie the other way).
    free = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    stop = free[5:7]
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=[stop])
    assert stop not in r.choices[0].text and r.choices[0].finish_reason == "stop"
    assert free.startswith(r.choices[0].text)
    s = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=stop, stream=True)
    streamed = "".join(c.choices[0].text for c in s if c.choices)
    assert streamed == r.choices[0].text
    kept = http.post("/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 20, "temperature": 0, "stop": [stop], "no_stop_trim": True}}).json()
    assert kept["text"].endswith(stop) and kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_structured_output_validates(oai, http):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather?"}], max_tokens=40,
                                    temperature=1.0, seed=4, response_format={
                                        "type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    g = http.post("/generate", json={"text": "plate: ", "sampling_params": {
        "max_new_tokens": 20, "temperature": 1.0, "regex": "[A-Z]{3}-[0-9]{2}"}}).json()
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", g["text"]), g
    e = http.post("/generate", json={"text": "x", "sampling_params": {"ebnf": 'root ::= "yes" | "no"'}}).json()
    assert e["text"] in ("yes", "no")
    bad = http.post("/generate", json={"text": "x", "sampling_params": {"regex": "(unclosed"}})
    assert bad.status_code == 400 and "grammar" in bad.json()["error"]["message"]


def test_tool_choice_required_and_named_return_parseable_calls(oai):
    msgs = [{"role": "user", "content": "What's the weather in Paris?"}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=120,
                                    temperature=1.0, seed=2, parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name in ("get_weather", "get_time") and isinstance(json.loads(calls[0].function.arguments), dict)
    named = {"type": "function", "function": {"name": "get_time"}}
    s = oai.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=named, max_tokens=120,
                                    stream=True, temperature=1.0, seed=3)
    deltas = [tc for c in s if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    args = "".join(d.function.arguments or "" for d in deltas)
    assert deltas[0].function.name == "get_time" and json.loads(args)["tz"] in ("UTC", "CET")
    history = msgs + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
                      {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}]
    follow = oai.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    assert follow.choices[0].message.role == "assistant"


def test_errors_in_openai_shape(oai, http):
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"
    assert http.get("/v1/models/gpt-9").status_code == 404 and http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "use_beam_search": True})
    assert r.status_code == 400 and "use_beam_search" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "logit_bias": {"99999": 1}})
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                                                "conversation_id": "c1", "frobnicate": 2})
    assert r.status_code == 200 and r.headers["x-strata-ignored-fields"] == "conversation_id,frobnicate"
    r = http.post("/generate", json={"text": "x", "sampling_params": {"beam": 4}})
    assert r.status_code == 422 and "beam" in json.dumps(r.json())
    r = http.post("/generate", json={"text": "x", "lora_path": "my-adapter"})
    assert r.status_code == 400 and "my-adapter" in r.json()["error"]["message"]
    for ids, bad_id in (([5, -3, 7, -1], -3), ([5, 10**6, 6], 10**6)):   # the first id out of range is named
        r = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 400 and f"token id {bad_id} is outside" in r.json()["error"]["message"], r.text
    r = http.post("/generate", json={"input_ids": [[5, 6], [7, 10**6]], "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("input_ids[1]: token id 1000000"), r.text
    defaults = {"frequency_penalty": 0, "presence_penalty": 0, "stop": [], "logprobs": False, "logit_bias": {},
                "best_of": 1, "store": False, "metadata": {}, "repetition_penalty": 1.0, "ignore_eos": False,
                "max_tokens": 2, "user": "u", "parallel_tool_calls": True, "service_tier": "auto"}
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}], **defaults})
    assert r.status_code == 200, r.text


def test_bodies_form_encoded_means_json_and_oversized_is_413(http):
    # curl -d sends form encoding by default (or no content type at all): still a JSON body here
    body = b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}'
    for ctype in ("application/x-www-form-urlencoded", None):
        r = http.post("/generate", content=body, headers={"content-type": ctype} if ctype else {})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 2, r.text
    r = http.post("/generate", content=b"{" + b" " * (4 << 20) + b"}", headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceed the limit" in r.json()["error"]["message"]
    r = http.post("/generate", content=b"\xff\xfe{not json", headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500


def test_sglang_generate_schema(http):
    r = http.post("/generate", json={"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": {
        "max_new_tokens": 3, "n": 2, "temperature": 1.0}, "rid": ["a", "b"]}).json()
    assert [o["meta_info"]["id"] for o in r] == ["a-0", "a-1", "b-0", "b-1"]
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in r)
    # One engine: it prefills and decodes, nobody predicted its hits (the answer leaves out nulls).
    assert all(o["meta_info"]["route"] == {"prefill": "local"} for o in r)
    with http.stream("POST", "/generate", json={"text": "hello there", "stream": True, "return_logprob": True,
                                                "logprob_start_len": 0, "top_logprobs_num": 2,
                                                "return_text_in_logprobs": True,
                                                "sampling_params": {"max_new_tokens": 4}}) as resp:
        ev = _events(resp)
    for e in ev:
        assert {"id", "prompt_tokens", "completion_tokens", "cached_tokens"} <= set(e["meta_info"])
        assert e["meta_info"]["route"] == {"prefill": "local", "decode": None}   # streamed chunks keep nulls
    last = ev[-1]["meta_info"]
    assert len(last["output_token_logprobs"]) == 4 and len(last["input_token_logprobs"]) == 11
    assert last["input_token_logprobs"][0][0] is None and last["input_token_logprobs"][1][2] == "e"
    info = http.get("/get_server_info").json()
    assert info["page_size"] == 16 and "last_gen_throughput" in info["internal_states"][0]
    assert http.get("/get_model_info").json()["is_generation"] is True
