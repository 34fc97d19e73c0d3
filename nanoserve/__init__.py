"""nanoserve: a small, readable LLM inference engine (paged KV cache, continuous batching, prefix
caching, CUDA graphs, tensor parallelism). Start at llm_engine.LLM; the README tells the life of a request."""
from nanoserve.config import SamplingParams
from nanoserve.llm_engine import LLM, LLMEngine

__all__ = ["LLM", "LLMEngine", "SamplingParams"]
