"""nanoserve: a small, readable LLM inference engine; exports LLM, LLMEngine and SamplingParams
(and GuidedDecodingParams, the guided extension's, imported on first use).

Paged KV cache, continuous batching, prefix caching, CUDA graphs, tensor parallelism.
Start reading at llm_engine.LLM; the README tells the life of a request through the code."""
from nanoserve.config import SamplingParams, extension
from nanoserve.llm_engine import LLM, LLMEngine

__all__ = ["LLM", "LLMEngine", "SamplingParams"]


def __getattr__(name: str) -> type:
    if name != "GuidedDecodingParams":
        raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")
    return extension("guided").GuidedDecodingParams
