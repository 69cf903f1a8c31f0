"""One worker's inference engine (no Ray).

The names below load on first use: the HTTP ingress imports the engine's torch-free parts (sampling
parameters, stream items, the tokenizer) and must not pay for torch, which ``Engine`` needs."""
import importlib

_EXPORTS = {"Engine": "engine.engine", "EngineConfig": "engine.config", "GenerationOutput": "engine.engine",
            "SamplingParams": "engine.sampling", "StepOutput": "engine.engine"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
