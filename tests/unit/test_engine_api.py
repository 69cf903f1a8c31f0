"""The offline API: outputs, sampling options, stop conditions and errors on bad input."""
import pytest

from engine import Engine, SamplingParams


@pytest.fixture(scope="module")
def eng():
    return Engine.from_pretrained("strata-tiny", page_size=16, num_pages=64, max_batch_tokens=128)


def test_output_fields_and_text_prompts(eng):
    out = eng.generate(["hello there", [1, 2, 3]], SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert [o.prompt_tokens for o in out] == [11, 3]
    for o in out:
        assert len(o.token_ids) == 5 and o.finish_reason == "length"
        assert isinstance(o.text, str) and o.cached_tokens == 0
    assert eng.requests == {}


def test_seeded_sampling_is_reproducible_and_batch_independent(eng):
    sp = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=50, top_p=0.9, seed=123, ignore_eos=True)
    a = eng.generate([[5, 6, 7]], sp)[0].token_ids
    b = eng.generate([[9] * 40, [5, 6, 7]], [SamplingParams(max_new_tokens=3), sp])[1].token_ids
    assert a == b
    c = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=12, temperature=0.9, seed=124,
                                                 ignore_eos=True))[0].token_ids
    assert c != a


def test_top_k_one_is_greedy(eng):
    g = eng.generate([[4, 4, 4]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
    k1 = eng.generate([[4, 4, 4]], SamplingParams(max_new_tokens=8, temperature=1.5, top_k=1,
                                                  ignore_eos=True))[0].token_ids
    assert g == k1


def test_stop_token_ids_and_eos(eng):
    base = eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=10, ignore_eos=True))[0].token_ids
    stop = base[3]
    out = eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=10, stop_token_ids=(stop,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == base[:base.index(stop) + 1]
    zero = eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=0))[0]
    assert zero.token_ids == [] and zero.finish_reason == "length"


@pytest.mark.parametrize("prompt, params, field", [
    ([], None, "prompt"),
    ("", None, "prompt"),
    ([1, 2, 264], None, "prompt"),
    ([1, -1], None, "prompt"),
    ([1, 2.5], None, "prompt"),
    ([1, True], None, "prompt"),                       # a bool is not a token id, though an int subclass
    ([1, None], None, "prompt"),
    ([1] * 2000, None, "prompt"),                      # beyond the pool: 64 pages of 16
    ([1] * 9000, None, "prompt"),                      # beyond the context of 8192
    ([1], SamplingParams(max_new_tokens=5000), "prompt"),
])
def test_bad_requests_raise_value_error_naming_the_field(eng, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        eng.generate([prompt], params)
    assert eng.requests == {} and eng.pools.all_free()


def test_prompt_ids_of_any_integer_kind_are_the_same_prompt(eng):
    """Plain ints take a fast path (engine.encode); integral floats, numpy ints and a tensor are read as
    before; the caller's list is never the request's."""
    import numpy as np
    import torch
    ids = [5, 6, 7, 8]
    assert eng.encode(ids) == ids and eng.encode(ids) is not ids
    for same in ([5.0, 6, 7, 8], [np.int64(t) for t in ids], tuple(ids), torch.tensor(ids)):
        got = eng.encode(same)
        assert got == ids and all(type(t) is int for t in got)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(stop_token_ids=(-3,)), "stop_token_ids"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(page_size=0), "page_size"),
    (dict(num_pages=-5), "num_pages"),
    (dict(swa_full_ratio=0), "swa_full_ratio"),
    (dict(max_batch_tokens=0), "max_batch_tokens"),
    (dict(dtype="int8"), "dtype"),
    (dict(bogus=1), "unknown engine options"),
    (dict(num_pages=8, swa_full_ratio=0.1), "swa_full_ratio"),
])
def test_bad_engine_options(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Engine.from_pretrained("strata-tiny", **kwargs)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ValueError, match="model"):
        Engine.from_pretrained(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="model"):
        Engine.from_pretrained(str(tmp_path))


def test_tokenizer_loads_in_transformers():
    from transformers import AutoTokenizer
    eng = Engine.from_pretrained("strata-tiny", num_pages=16)
    tok = AutoTokenizer.from_pretrained(eng.model_path)
    text = "multi-turn, ünïcode ✓"
    assert tok(text, add_special_tokens=False)["input_ids"] == eng.tokenizer.encode(text)
    assert tok.decode(eng.tokenizer.encode(text)) == text
    assert tok.eos_token_id in eng.model_config.eos_token_id
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|start|>assistant<|message|>")
