"""nanoserve: a small, readable LLM inference engine; exports LLM, LLMEngine and SamplingParams.

Paged KV cache, continuous batching, prefix caching, CUDA graphs, tensor parallelism.
Start reading at llm_engine.LLM; the README tells the life of a request through the code."""
from nanoserve.config import SamplingParams
from nanoserve.llm_engine import LLM, LLMEngine

__all__ = ["LLM", "LLMEngine", "SamplingParams"]
