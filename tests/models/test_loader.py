"""The loader: MXFP4 decoding against transformers' own, and every malformed checkpoint refused with a
ValueError naming the tensor or field."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine
from engine.model import mxfp4
from engine.model.config import ModelConfig
from engine.model.loader import load_model

from .families import write_family


def test_mxfp4_dequantize_matches_transformers_on_every_byte_and_scale():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=g, dtype=torch.uint8)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17        # every nibble, both halves
    scales = torch.randint(117, 138, (3, 8, 4), generator=g, dtype=torch.uint8)
    ours = mxfp4.dequantize_weight(blocks, scales, torch.float32)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).float()
    assert ours.shape == theirs.shape == (3, 128, 8)
    assert torch.equal(ours, theirs)    # both exact: FP4 values times powers of two


def test_mxfp4_quantize_round_trips_representable_values_and_bounds_the_error():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, 64, 96, generator=g)
    blocks, scales = mxfp4.quantize_weight(w)
    assert blocks.shape == (2, 96, 2, 16) and scales.shape == (2, 96, 2)
    deq = mxfp4.dequantize_weight(blocks, scales, torch.float32)
    again = mxfp4.dequantize_weight(*mxfp4.quantize_weight(deq), torch.float32)
    assert torch.equal(deq, again)
    # Round to nearest E2M1 under a per-32 scale 2**e < amax / 3: an error of at most half the widest
    # gap (between 4 and 6), i.e. 2**e.
    amax = w.transpose(1, 2).reshape(2, 96, 2, 32).abs().amax(-1, keepdim=True)
    err = (deq - w).transpose(1, 2).reshape(2, 96, 2, 32).abs()
    assert (err <= amax / 3 + 1e-6).all()


@pytest.fixture(scope="module")
def qwen_moe(tmp_path_factory):
    return write_family("qwen3_moe", tmp_path_factory.mktemp("q"))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path, fn):
    f = path / "model.safetensors"
    sd = load_file(str(f))
    fn(sd)
    save_file(sd, str(f), metadata={"format": "pt"})


def test_missing_extra_and_misshaped_tensors_are_named(qwen_moe, tmp_path):
    cases = {
        "missing": (lambda sd: sd.pop("model.layers.0.self_attn.q_norm.weight"),
                    "missing ['model.layers.0.self_attn.q_norm.weight']"),
        "extra": (lambda sd: sd.__setitem__("model.layers.0.mlp.shared_expert.weight", torch.zeros(2)),
                  "unexpected ['model.layers.0.mlp.shared_expert.weight']"),
        "shape": (lambda sd: sd.__setitem__("model.layers.2.self_attn.k_proj.weight", torch.zeros(16, 64)),
                  "model.layers.2.self_attn.k_proj.weight has shape (16, 64)"),
        "expert": (lambda sd: sd.pop("model.layers.2.mlp.experts.7.up_proj.weight"),
                   "model.layers.2.mlp.experts.7.up_proj.weight"),
        "dtype": (lambda sd: sd.__setitem__("model.norm.weight", torch.ones(64, dtype=torch.int32)),
                  "model.norm.weight has dtype torch.int32"),
    }
    for name, (fn, msg) in cases.items():
        p = _copy(qwen_moe, tmp_path / name)
        _edit_tensors(p, fn)
        with pytest.raises(ValueError) as e:
            load_model(p)
        assert msg in str(e.value), (name, str(e.value))


def test_bad_configs_are_named(qwen_moe, tmp_path):
    def with_config(name, edit):
        p = _copy(qwen_moe, tmp_path / name)
        d = json.loads((p / "config.json").read_text())
        edit(d)
        (p / "config.json").write_text(json.dumps(d))
        return p

    cases = {
        "arch": (lambda d: d.update(architectures=["MambaForCausalLM"]), "MambaForCausalLM"),
        "field": (lambda d: d.pop("num_experts_per_tok"), "'num_experts_per_tok' is missing"),
        "rope": (lambda d: d.update(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}), "rope_type 'dynamic'"),
        "heads": (lambda d: d.update(num_key_value_heads=3), "num_key_value_heads"),
    }
    for name, (edit, msg) in cases.items():
        with pytest.raises(ValueError, match=msg):
            ModelConfig.from_dir(with_config(name, edit))
    bad = _copy(qwen_moe, tmp_path / "json")
    (bad / "config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_dir(bad)


def test_mxfp4_blocks_without_scales_and_eplb_on_a_dense_model_are_refused(tmp_path):
    p = write_family("gpt_oss_mxfp4", tmp_path / "gpt")
    idx = json.loads((p / "model.safetensors.index.json").read_text())
    name = "model.layers.0.mlp.experts.down_proj_scales"
    shard = p / idx["weight_map"][name]
    sd = load_file(str(shard))
    sd.pop(name)
    save_file(sd, str(shard), metadata={"format": "pt"})
    del idx["weight_map"][name]
    (p / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(ValueError, match="down_proj_blocks has no matching"):
        load_model(p)
    dense = write_family("qwen3", tmp_path / "dense")
    from engine.eplb import EplbConfig
    with pytest.raises(ValueError, match="no MoE layers"):
        Engine.from_pretrained(str(dense), num_pages=64, eplb=EplbConfig(num_ranks=2))


@pytest.mark.numerics
def test_bf16_and_fp16_checkpoints_load_and_dtype_auto_follows_torch_dtype(tmp_path):
    from transformers import AutoModelForCausalLM

    from engine import SamplingParams
    from tests import numerics
    from tests.unit.hf_ref import hf_greedy
    src = write_family("qwen3", tmp_path / "fp32")
    prompt = list(range(3, 40))
    for dt in (torch.bfloat16, torch.float16):
        p = tmp_path / str(dt)
        AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(dt).save_pretrained(p)
        shutil.copy(src / "tokenizer.json", p / "tokenizer.json")
        auto = Engine.from_pretrained(str(p), num_pages=64, dtype="auto")
        assert auto.cfg.dtype == str(dt).removeprefix("torch.") and auto.pools.full.kv.dtype == dt
        # Upcast to fp32 on both sides: the same weights, so the same tokens as transformers.
        eng = Engine.from_pretrained(str(p), num_pages=64, dtype="float32")
        got = eng.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True, return_logits=True))[0]
        hf = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32, attn_implementation="eager").eval()
        numerics.assert_same_output(got, hf_greedy(hf, prompt, 6), eng.model_config, f"{dt} checkpoint")


def test_generation_config_sampling_defaults_apply_where_the_request_is_silent(tmp_path):
    from fastapi.testclient import TestClient

    from actors.http_api import build_app
    from actors.local_backend import LocalBackend
    p = write_family("llama", tmp_path / "m")
    (p / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [256, 257], "temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True}))
    assert load_model(p)[0].eos_token_id == (256, 257)     # config.json's 256 joined by 257

    class Capture(LocalBackend):
        seen: list = []

        def stream(self, ids, params, avoid=(), pin=None, whole=False):
            self.seen.append(params)
            return super().stream(ids, params, avoid, pin, whole)

    backend = Capture.from_pretrained(str(p), model_name="m", num_pages=64)
    with TestClient(build_app(backend)) as c:
        assert c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}).status_code == 200
        assert c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2,
                                               "temperature": 1.0, "top_k": -1}).status_code == 200
        assert c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
        assert c.post("/generate", json={"text": "hi", "sampling_params": {
            "max_new_tokens": 2, "top_p": 0.5}}).status_code == 200
    silent, explicit, sgl, sgl_top_p = Capture.seen
    assert (silent.temperature, silent.top_p, silent.top_k) == (0.6, 0.95, 20)
    assert (explicit.temperature, explicit.top_p, explicit.top_k) == (1.0, 0.95, 0)
    assert (sgl.temperature, sgl.top_p, sgl.top_k) == (0.6, 0.95, 20)
    assert (sgl_top_p.temperature, sgl_top_p.top_p) == (0.6, 0.5)
