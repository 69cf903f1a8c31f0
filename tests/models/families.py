"""Tiny seeded checkpoints of each supported family, written by transformers' own classes
(``save_pretrained``: the layout model publishers release), and transformers' greedy answer on them.

Weights are re-drawn from a seeded generator with the scales of engine/model/loader.random_state_dict,
so logits have clear winners and greedy decoding is robust to float rounding across CPUs.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.model import mxfp4
from engine.model.loader import random_state_dict, save_checkpoint, tiny_config
from engine.model.tokenizer import write_byte_tokenizer

VOCAB = 264          # the byte tokenizer's 256 bytes + specials
EOS = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=EOS,
              pad_token_id=EOS, bos_token_id=None)

# window (tokens) of the sliding layers, when the family has any; prompts span several windows.
WINDOWS = {"gemma3": 16, "gemma3_legacy": 24, "gpt_oss_mxfp4": 64}


def _hf_config(family: str):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config, Qwen3MoeConfig
    if family == "llama":   # Llama 3.2-style: tied embeddings, llama3 RoPE scaling that bites at tiny lengths
        return LlamaConfig(**COMMON, tie_word_embeddings=True, rope_parameters=dict(
            rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64), max_position_embeddings=1024)
    if family == "qwen3":
        return Qwen3Config(**COMMON, tie_word_embeddings=False, max_position_embeddings=1024)
    if family == "qwen3_moe":   # the second layer dense (mlp_only_layers), renormalised top-k
        c = dict(COMMON, num_hidden_layers=3)
        return Qwen3MoeConfig(**c, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=1024)
    if family in ("gemma3", "gemma3_legacy"):   # 5 sliding : 1 global, local/global RoPE, soft-capping
        c = dict(COMMON, num_hidden_layers=6, head_dim=16)
        return Gemma3TextConfig(**c, sliding_window=WINDOWS[family], query_pre_attn_scalar=24,
                                final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                                rope_parameters={
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                       "rope_theta": 1000000.0}},
                                max_position_embeddings=1024)
    raise ValueError(family)


def _reseed(model, seed: int, gemma_norms: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                t = 0.1 * torch.randn(p.shape, generator=g) + (0.0 if gemma_norms else 1.0)
            elif name.endswith("embed_tokens.weight"):
                t = torch.randn(p.shape, generator=g) * (0.125 if gemma_norms else 1.0)  # Gemma scales by 8
            elif name == "lm_head.weight":
                t = 0.5 * torch.randn(p.shape, generator=g)
            elif name.endswith("bias"):
                t = 0.05 * torch.randn(p.shape, generator=g)
            else:
                fan_in = p.shape[-1] if p.dim() == 2 else min(p.shape[-2:])
                t = torch.randn(p.shape, generator=g) * (1.5 / fan_in ** 0.5)
            p.copy_(t)


def _legacy_gemma_config(path: Path) -> None:
    """Rewrite config.json as released Gemma 3 checkpoints (transformers 4.5x) carry it."""
    d = json.loads((path / "config.json").read_text())
    rp = d.pop("rope_parameters")
    d.pop("layer_types")
    d.pop("_sliding_window_pattern", None)
    d.update(rope_theta=rp["full_attention"]["rope_theta"], rope_local_base_freq=rp["sliding_attention"]["rope_theta"],
             rope_scaling={"rope_type": "linear", "factor": rp["full_attention"]["factor"]},
             sliding_window_pattern=6, torch_dtype=d.pop("dtype", "float32"))
    (path / "config.json").write_text(json.dumps(d, indent=2))


def write_family(family: str, path: Path, seed: int = 7, shard: bool = False) -> Path:
    """A checkpoint directory of ``family`` with the byte tokenizer; sharded with an index if asked."""
    from transformers import AutoModelForCausalLM
    if family == "gpt_oss_mxfp4":
        return write_gpt_oss_mxfp4(path, seed)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_hf_config(family), dtype=torch.float32)
    _reseed(model, seed, family.startswith("gemma3"))
    model.save_pretrained(path, max_shard_size="60KB" if shard else "2GB")
    write_byte_tokenizer(Path(path))
    if family == "gemma3_legacy":
        _legacy_gemma_config(Path(path))
    return Path(path)


def write_gpt_oss_mxfp4(path: Path, seed: int = 7) -> Path:
    """strata-tiny's architecture with its experts stored as GPT-OSS releases them: MXFP4 blocks and
    scales (bf16 biases), ``quantization_config.quant_method = mxfp4``, sharded with an index."""
    cfg = tiny_config()
    sd = random_state_dict(cfg, seed)
    for name in [n for n in sd if n.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = mxfp4.quantize_weight(sd.pop(name))
        sd[name + "_blocks"], sd[name + "_scales"] = blocks, scales
    for name in [n for n in sd if n.endswith("_proj_bias") and ".experts." in n]:
        sd[name] = sd[name].to(torch.bfloat16)
    save_checkpoint(path, cfg, sd, shards=3)
    d = json.loads((Path(path) / "config.json").read_text())
    d["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (Path(path) / "config.json").write_text(json.dumps(d, indent=2))
    return Path(path)


def load_hf(family: str, path):
    """transformers' model on the checkpoint: the oracle (eager attention, fp32; MXFP4 dequantized)."""
    from transformers import AutoModelForCausalLM
    kw = {}
    if family == "gpt_oss_mxfp4":
        from transformers import Mxfp4Config
        kw["quantization_config"] = Mxfp4Config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32, **kw)
    # Some transformers versions keep dequantized MXFP4 experts in bf16 whatever dtype asks for (5.17 on
    # the GPU image: its answers then carry bf16 rounding). MXFP4 values are exact in bf16, so casting
    # back loses nothing and the oracle computes in fp32 on every version.
    return model.float().eval()
