"""One worker's inference engine (no Ray)."""
from engine.config import EngineConfig
from engine.engine import Engine, GenerationOutput, StepOutput
from engine.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "GenerationOutput", "SamplingParams", "StepOutput"]
