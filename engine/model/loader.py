"""Loading Hugging Face checkpoints (config.json + safetensors, sharded or not), and the seeded
``strata-tiny`` model's config and weights (engine/model/checkpoint.py finds a checkpoint, and makes
strata-tiny's on first use, so nothing is ever downloaded)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.model.config import FULL_ATTN, SLIDING, ModelConfig, RopeConfig
from engine.model.convert import to_strata
from engine.model.generation_config import generation_eos
from engine.model.decoder import CausalLM
from engine.model.registry import build_model
from engine.model.tokenizer import write_byte_tokenizer

def tiny_config(**overrides) -> ModelConfig:
    """The seeded tiny hybrid model: 4 layers alternating sliding/full, window 64, 8 experts top-2."""
    base = dict(
        vocab_size=264, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=64,
        layer_types=(SLIDING, FULL_ATTN, SLIDING, FULL_ATTN), max_position_embeddings=8192,
        eos_token_id=(256,), pad_token_id=256,
        rope=RopeConfig(theta=150000.0, rope_type="yarn", factor=2.0, beta_fast=32.0, beta_slow=1.0,
                        original_max_position_embeddings=4096, truncate=False),
    )
    base.update(overrides)
    return ModelConfig(**base)


def random_state_dict(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights, scaled so attention is far from uniform and logits have clear winners
    (greedy decoding of a random model is then robust to float rounding)."""
    g = torch.Generator().manual_seed(seed)
    model = build_model(cfg)
    sd = {}
    for name, p in model.state_dict().items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        elif name == "lm_head.weight":
            t = 0.5 * torch.randn(p.shape, generator=g)
        elif name.endswith("embed_tokens.weight"):
            t = torch.randn(p.shape, generator=g)
        elif name.endswith("sinks"):
            t = torch.randn(p.shape, generator=g)
        elif name.endswith("bias"):
            t = 0.05 * torch.randn(p.shape, generator=g)
        else:
            fan_in = p.shape[-2] if name.endswith(("gate_up_proj", "down_proj")) else p.shape[-1]
            t = torch.randn(p.shape, generator=g) * (1.5 / fan_in ** 0.5)
        sd[name] = t.to(torch.float32).contiguous()
    return sd


def save_checkpoint(path: str | Path, cfg: ModelConfig, sd: dict[str, torch.Tensor],
                    shards: int = 1, with_tokenizer: bool = True) -> Path:
    """Write config.json + safetensors (an index when ``shards`` > 1) + the byte tokenizer."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if with_tokenizer:
        write_byte_tokenizer(path)
    names = sorted(sd)
    if shards <= 1:
        save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        per = -(-len(names) // shards)
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: sd[n] for n in names[i * per:(i + 1) * per]}
            save_file(part, str(path / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        total = sum(t.numel() * t.element_size() for t in sd.values())
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    return path


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(f.name for f in path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors in {path}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(path / f)))
    return sd


def load_config(path: Path) -> ModelConfig:
    """config.json, with generation_config.json's eos ids joined to its own."""
    cfg = ModelConfig.from_dir(path)
    extra = tuple(e for e in generation_eos(path) if e not in cfg.eos_token_id)
    return dataclasses.replace(cfg, eos_token_id=cfg.eos_token_id + extra) if extra else cfg


def load_model(path: Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> tuple[ModelConfig, CausalLM]:
    cfg = load_config(path)
    model = build_model(cfg)
    sd = to_strata(load_state_dict(path), cfg, model.state_dict(), dtype)
    model.load_state_dict(sd, strict=True)
    model = model.to(device=device, dtype=dtype)
    if cfg.tie_word_embeddings:   # one tensor, not two copies (Gemma 3: 262k x hidden)
        model.lm_head.weight = model.model.embed_tokens.weight
    # Norm weights stay fp32 like the reference implementations.
    for m in model.modules():
        if m.__class__.__name__ == "RMSNorm":
            m.weight.data = m.weight.data.float()
    for rot in (model.rotary, model.rotary_local):
        if rot is not None:
            rot.inv_freq = rot.inv_freq.float()
    model.eval()
    return cfg, model
