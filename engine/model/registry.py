"""The model registry: ``architectures[0]`` of a config.json -> the family's config parser and model
class. Each family declares its layer spec (per layer: full or sliding, and the window) in the
``ModelConfig`` its parser returns; pools, the radix tree, the P/D leases and the router are sized from
that spec (storage/geometry.py ``KVGeometry``), never from a model name.

The parsers are plain Python (engine/model/hf_config.py); a family's module (its model class, and torch
with it) is imported only when a model is built, so the launcher (``strata serve``, a RayJob's driver),
which reads only a checkpoint's layer spec, never loads torch."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, NamedTuple

from engine.model import hf_config
from engine.model.config import ModelConfig

if TYPE_CHECKING:
    from engine.model.decoder import CausalLM


class Family(NamedTuple):
    parse: Callable[[dict], ModelConfig]
    model: str   # "module:Class" of the family's model (engine/model/<family>.py)


ARCHITECTURES: dict[str, Family] = {
    "GptOssForCausalLM": Family(hf_config.parse_gpt_oss, "engine.model.gpt_oss:GptOssForCausalLM"),
    "LlamaForCausalLM": Family(hf_config.parse_llama, "engine.model.llama:LlamaForCausalLM"),
    "Qwen3ForCausalLM": Family(hf_config.parse_qwen3, "engine.model.qwen3:Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": Family(hf_config.parse_qwen3_moe, "engine.model.qwen3:Qwen3MoeForCausalLM"),
    "Gemma3ForCausalLM": Family(hf_config.parse_gemma3, "engine.model.gemma3:Gemma3ForCausalLM"),
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


def model_class(architecture: str) -> type[CausalLM]:
    """The family's model class (its module imported now)."""
    module, name = ARCHITECTURES[architecture].model.split(":")
    return getattr(importlib.import_module(module), name)


def build_model(cfg: ModelConfig) -> CausalLM:
    return model_class(cfg.architecture)(cfg)
