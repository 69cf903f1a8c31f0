"""Model configuration: one frozen description of a decoder-only checkpoint, whatever its family.

``ModelConfig`` says what each layer is (sliding or full attention, window, RoPE of its type, MoE or
dense MLP) and which variant of each block the family uses (attention sinks, q/k norms, Gemma's
``1 + weight`` norms and sandwich norms, soft-capping, embedding scale). ``engine/model/hf_config.py``
maps a Hugging Face ``config.json`` onto it, one parser per architecture.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SLIDING = "sliding_attention"
FULL_ATTN = "full_attention"
ROPE_TYPES = ("default", "yarn", "linear", "llama3")
ACTS = ("silu", "gelu_pytorch_tanh")
EXPERT_ACTS = ("swiglu_clamped", "silu")
ROUTERS = ("topk_softmax", "softmax_topk")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE of one layer type. ``rope_type``: default, yarn (YaRN), linear (position interpolation) or
    llama3 (Llama 3.1's smoothed low-frequency scaling)."""

    theta: float = 150000.0
    rope_type: str = "default"
    factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 4096
    truncate: bool = True
    attention_factor: float | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported {ROPE_TYPES}")
        if self.theta <= 0:
            raise ValueError(f"rope theta must be > 0, got {self.theta}")
        if self.factor <= 0:
            raise ValueError(f"rope factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError("rope_scaling: llama3 needs high_freq_factor > low_freq_factor > 0")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str = "GptOssForCausalLM"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    # MoE: 0 experts is a dense model; moe_intermediate_size 0 means intermediate_size.
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    router: str = "topk_softmax"          # GPT-OSS: top-k of the logits, softmax over those k
    norm_topk_prob: bool = False          # softmax_topk only: renormalise the k chosen weights
    expert_act: str = "swiglu_clamped"
    router_bias: bool = True
    expert_bias: bool = True
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    hidden_act: str = "silu"              # dense MLP activation
    mlp_bias: bool = False
    # Attention.
    sliding_window: int = 64
    layer_types: tuple[str, ...] = ()
    attention_bias: bool = True
    attention_sinks: bool = True
    qk_norm: bool = False
    query_pre_attn_scalar: float | None = None   # scale = this ** -0.5 (default head_dim ** -0.5)
    # Norms, embeddings, head.
    rms_norm_eps: float = 1e-5
    norm_offset: float = 0.0              # Gemma: the norm multiplies by (1 + weight)
    sandwich_norm: bool = False           # Gemma: pre/post feed-forward norms around the MLP
    embed_scale: float | None = None      # Gemma: embeddings times sqrt(hidden_size)
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    torch_dtype: str = "float32"
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_local: RopeConfig | None = None  # sliding layers' RoPE when it differs (Gemma 3)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                     "decoder_sparse_step"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(self.num_local_experts, int) or self.num_local_experts < 0:
            raise ValueError(f"num_local_experts must be an int >= 0, got {self.num_local_experts!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_local_experts and not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError("num_experts_per_tok must be in [1, num_local_experts]")
        for name, allowed in (("hidden_act", ACTS), ("expert_act", EXPERT_ACTS), ("router", ROUTERS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} {getattr(self, name)!r} is not supported {allowed}")
        if not self.layer_types:
            # GPT-OSS default: even layers slide, odd layers attend fully.
            object.__setattr__(self, "layer_types", tuple(
                SLIDING if (i + 1) % 2 else FULL_ATTN for i in range(self.num_hidden_layers)))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries, "
                             f"num_hidden_layers is {self.num_hidden_layers}")
        bad = set(self.layer_types) - {SLIDING, FULL_ATTN}
        if bad:
            raise ValueError(f"layer_types: unknown types {sorted(bad)}")
        if SLIDING in self.layer_types and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int, got {self.sliding_window!r}")
        for cap in ("final_logit_softcapping", "query_pre_attn_scalar"):
            v = getattr(self, cap)
            if v is not None and not v > 0:
                raise ValueError(f"{cap} must be > 0 or null, got {v!r}")

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == SLIDING]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTN]

    @property
    def window(self) -> int | None:
        """The sliding window in tokens, None when no layer slides."""
        return self.sliding_window if self.sliding_layers else None

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_local_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    def rope_for(self, layer_type: str) -> RopeConfig:
        return self.rope_local if layer_type == SLIDING and self.rope_local is not None else self.rope

    # ---- Hugging Face mapping -------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        from engine.model.registry import parse_hf_config
        return parse_hf_config(d)

    def to_hf_dict(self) -> dict:
        """The GPT-OSS ``config.json`` of this config (strata-tiny and the tests' checkpoints)."""
        if self.architecture != "GptOssForCausalLM":
            raise ValueError(f"to_hf_dict writes GPT-OSS configs only, not {self.architecture}")
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
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"model: {p} is not valid JSON ({e})") from None
        return cls.from_hf_dict(d)
