"""Model configuration read from a Hugging Face ``config.json`` of the GPT-OSS architecture."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SLIDING = "sliding_attention"
FULL_ATTN = "full_attention"


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters. ``rope_type`` is ``default`` or ``yarn`` (YaRN context extension)."""

    theta: float = 150000.0
    rope_type: str = "default"
    factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 4096
    truncate: bool = True
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "yarn"):
            raise ValueError(f"rope_type {self.rope_type!r} is not supported (default, yarn)")
        if self.theta <= 0:
            raise ValueError(f"rope theta must be > 0, got {self.theta}")
        if self.factor <= 0:
            raise ValueError(f"rope factor must be > 0, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    sliding_window: int = 64
    layer_types: tuple[str, ...] = ()
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    rope: RopeConfig = field(default_factory=RopeConfig)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts",
                     "num_experts_per_tok", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError("num_experts_per_tok must be <= num_local_experts")
        if not self.layer_types:
            # GPT-OSS default: even layers slide, odd layers attend fully.
            object.__setattr__(self, "layer_types", tuple(
                SLIDING if (i + 1) % 2 else FULL_ATTN for i in range(self.num_hidden_layers)))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries, "
                             f"num_hidden_layers is {self.num_hidden_layers}")
        bad = set(self.layer_types) - {SLIDING, FULL_ATTN}
        if bad:
            raise ValueError(f"layer_types: unknown types {sorted(bad)}")
        if SLIDING in self.layer_types and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int, got {self.sliding_window!r}")

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == SLIDING]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTN]

    # ---- Hugging Face mapping -------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        if d.get("model_type", "gpt_oss") != "gpt_oss":
            raise ValueError(f"model_type {d.get('model_type')!r} is not gpt_oss")
        rp = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rp.get("rope_theta", d.get("rope_theta", 150000.0))
        rope = RopeConfig(
            theta=float(theta),
            rope_type=rp.get("rope_type", rp.get("type", "default")) or "default",
            factor=float(rp.get("factor", 1.0) or 1.0),
            beta_fast=float(rp.get("beta_fast") or 32.0),
            beta_slow=float(rp.get("beta_slow") or 1.0),
            original_max_position_embeddings=int(rp.get("original_max_position_embeddings",
                                                        d.get("max_position_embeddings", 4096))),
            truncate=bool(rp.get("truncate", True)),
            attention_factor=rp.get("attention_factor"),
        )
        eos = d.get("eos_token_id")
        eos = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),))
        n_heads = d["num_attention_heads"]
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // n_heads,
            num_local_experts=d["num_local_experts"], num_experts_per_tok=d["num_experts_per_tok"],
            sliding_window=d.get("sliding_window") or 0,
            layer_types=tuple(d.get("layer_types") or ()),
            max_position_embeddings=d.get("max_position_embeddings", 131072),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5), swiglu_limit=d.get("swiglu_limit", 7.0),
            swiglu_alpha=d.get("swiglu_alpha", 1.702),
            attention_bias=d.get("attention_bias", True),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            eos_token_id=eos, pad_token_id=d.get("pad_token_id"), rope=rope,
        )

    def to_hf_dict(self) -> dict:
        r = self.rope
        rope_parameters = {"rope_type": r.rope_type, "rope_theta": r.theta}
        if r.rope_type == "yarn":
            rope_parameters.update(factor=r.factor, beta_fast=r.beta_fast, beta_slow=r.beta_slow,
                                   original_max_position_embeddings=r.original_max_position_embeddings,
                                   truncate=r.truncate)
        return {
            "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "num_local_experts": self.num_local_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "sliding_window": self.sliding_window, "layer_types": list(self.layer_types),
            "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": self.rms_norm_eps,
            "swiglu_limit": self.swiglu_limit, "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "eos_token_id": list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0],
            "pad_token_id": self.pad_token_id, "rope_parameters": rope_parameters,
            "hidden_act": "silu", "torch_dtype": "float32",
        }

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ValueError(f"model: no config.json in {path}")
        return cls.from_hf_dict(json.loads(p.read_text()))
