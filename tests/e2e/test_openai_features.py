"""The official ``openai`` client and SGLang-shaped JSON against the real cluster (2 prefill + 1 decode
workers: the first token is sampled on a prefill worker, the rest on the decode worker): parallel
samples, logprobs equal to log_softmax of the engine's logits, stop strings, structured output, tools."""
import json
import re

import httpx
import jsonschema
import openai
import pytest
import torch

from engine import Engine, SamplingParams
from tests import numerics

MODEL = "strata-tiny"
TOOLS = [{"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {"room": {"enum": ["A", "B"]}, "hours": {"type": "integer", "minimum": 1,
                                                                             "maximum": 9}},
    "required": ["room", "hours"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def oai(cluster):
    return openai.OpenAI(base_url=f"{cluster['url']}/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def reference(cluster):
    return Engine.from_pretrained(cluster["model_path"], page_size=16, num_pages=256)


def test_n2_gives_two_choices_and_the_samples_share_the_prompt(oai):
    msgs = [{"role": "user", "content": "a long shared question " * 8}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, n=2, temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 10
    again = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, n=2, temperature=1.0, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


@pytest.mark.numerics
def test_logprobs_across_prefill_and_decode_match_the_engine(oai, reference):
    prompt = "Logprobs, token by token: "
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
                               extra_body={"return_tokens_as_token_ids": True})
    want = reference.generate([reference.tokenizer.encode(prompt)], SamplingParams(max_new_tokens=6, return_logits=True))[0]
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 6
    ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    numerics.assert_same_logprobs(ids, lp.token_logprobs, want, reference.model_config, "prefill + decode")


def test_stop_strings_never_leak_and_grammars_hold(oai, cluster, reference):
    prompt = "Stop strings: "
    # The unstopped answer comes from the server itself: an engine of other batch shapes may break a
    # near-tie the other way.
    free = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    stop = free[4:6]
    s = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop], stream=True)
    streamed = "".join(c.choices[0].text for c in s if c.choices)
    assert stop not in streamed and free.startswith(streamed)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99,
                                                                                "minimum": 0}},
              "required": ["ok", "n"], "additionalProperties": False}
    c = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json"}], max_tokens=30,
                                    temperature=1.0, seed=3, response_format={
                                        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    jsonschema.validate(json.loads(c.choices[0].message.content), schema)
    g = httpx.post(f"{cluster['url']}/generate", json={"text": "id: ", "sampling_params": {
        "max_new_tokens": 12, "temperature": 1.0, "regex": "[a-f]{4}-[0-9]{3}"}}, timeout=60).json()
    assert re.fullmatch("[a-f]{4}-[0-9]{3}", g["text"]), g


def test_tool_choice_required_returns_a_parseable_call_and_unknown_models_are_404(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "book room A"}],
                                    tools=TOOLS, tool_choice="required", max_tokens=120, temperature=1.0, seed=1)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "book" and json.loads(call.function.arguments)["room"] in ("A", "B")
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="not-" + MODEL, prompt="x", max_tokens=1)
