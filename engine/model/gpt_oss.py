"""GPT-OSS (``GptOssForCausalLM``): alternating sliding (window 128) and full layers, per-head attention
sinks, biased attention, YaRN RoPE, MoE with a biased top-k router and clamped SwiGLU experts. Released
checkpoints store the experts as MXFP4 (dequantized by engine/model/convert.py at load).

Its config.json parser: engine/model/hf_config.py ``parse_gpt_oss`` (no torch there)."""
from __future__ import annotations

from engine.model.decoder import CausalLM


class GptOssForCausalLM(CausalLM):
    """The shared decoder with GPT-OSS's switches on (sinks, biases, MoE in every layer)."""
