"""The model registry: ``architectures[0]`` of a config.json -> the family's config parser and model
class. Each family declares its layer spec (per layer: full or sliding, and the window) in the
``ModelConfig`` its parser returns; pools, the radix tree, the P/D leases and the router are sized from
that spec (storage/geometry.py ``KVGeometry``), never from a model name."""
from __future__ import annotations

from typing import Callable, NamedTuple

from engine.model import gemma3, gpt_oss, llama, qwen3
from engine.model.config import ModelConfig
from engine.model.decoder import CausalLM


class Family(NamedTuple):
    parse: Callable[[dict], ModelConfig]
    model: type[CausalLM]


ARCHITECTURES: dict[str, Family] = {
    "GptOssForCausalLM": Family(gpt_oss.parse, gpt_oss.GptOssForCausalLM),
    "LlamaForCausalLM": Family(llama.parse, llama.LlamaForCausalLM),
    "Qwen3ForCausalLM": Family(qwen3.parse, qwen3.Qwen3ForCausalLM),
    "Qwen3MoeForCausalLM": Family(qwen3.parse_moe, qwen3.Qwen3MoeForCausalLM),
    "Gemma3ForCausalLM": Family(gemma3.parse, gemma3.Gemma3ForCausalLM),
}
# config.json files without ``architectures`` (older exports) name the family by model_type only.
MODEL_TYPES = {"gpt_oss": "GptOssForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def parse_hf_config(d: dict) -> ModelConfig:
    archs = d.get("architectures") or []
    arch = archs[0] if archs else MODEL_TYPES.get(d.get("model_type", "gpt_oss"))
    if arch not in ARCHITECTURES:
        raise ValueError(f"config.json: architectures {archs or d.get('model_type')!r} is not supported; "
                         f"strata serves {sorted(ARCHITECTURES)}")
    try:
        return ARCHITECTURES[arch].parse(d)
    except KeyError as e:
        raise ValueError(f"config.json: field {e.args[0]!r} is missing ({arch})") from None


def build_model(cfg: ModelConfig) -> CausalLM:
    return ARCHITECTURES[cfg.architecture].model(cfg)
