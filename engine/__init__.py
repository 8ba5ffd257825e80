"""gpt2-serve engine: `from engine import LLM, SamplingParams`."""
from engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from engine.core.messages import EngineStats
from engine.llm import LLM, LLMEngine
from engine.output.outputs import CompletionOutput, RequestOutput
from engine.core.request import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "EngineStats", "SamplingParams", "StructuredOutputsParams",
           "RequestOutput", "CompletionOutput", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence"]
