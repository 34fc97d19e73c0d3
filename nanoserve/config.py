"""Engine settings (Config) and per-request settings (SamplingParams), validated on construction.

Owns: every knob a user can turn, with its unit and effect, and the checks that reject bad values
with a message naming the fix. Does not own: the model itself (models.py) or any tensor.
Invariant: after LLM start-up a Config is read-only, except `num_kvcache_blocks`, which is only
known after the model runner has measured free memory and is filled in once.
Called by: llm_engine (builds both), scheduler, block_manager and model_runner (read them).
"""
import os
from dataclasses import dataclass

import torch
from transformers import AutoConfig, PretrainedConfig

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, without floats: how many b-sized pieces hold a."""
    return -(-a // b)


@dataclass
class Config:
    model: str  # Hugging Face layout directory: config.json, *.safetensors, tokenizer files
    max_num_seqs: int = 512  # most sequences in one batch (prefill or decode)
    max_num_batched_tokens: int = 16384  # tokens of one prefill step; longer prompts are chunked
    max_model_len: int = 4096  # most tokens (prompt + output) of one sequence
    gpu_memory_utilization: float = 0.9  # share of GPU memory for weights + KV + activations
    tensor_parallel_size: int = 1  # ranks; each holds 1/tp of the heads and of the MLP
    enforce_eager: bool = False  # True: no CUDA graphs for decode
    kvcache_block_size: int = 16  # tokens per KV block (the paging unit)
    num_kvcache_blocks: int | None = None  # None: sized from free memory; an int overrides
    enable_prefix_caching: bool = True  # reuse KV blocks of equal prompt prefixes across requests
    overlap_scheduling: bool = True  # launch the next step while this one runs (one rank only)
    dtype: str = "auto"  # "auto": the checkpoint's dtype on GPU, float32 on CPU; or a DTYPES key
    device: str = "auto"  # "auto": "cuda" when available, else "cpu"
    trace: bool = False  # log one line per engine step (also NANOSERVE_TRACE=1)

    def __post_init__(self) -> None:
        if not os.path.isdir(self.model):
            raise OSError(f"model directory {self.model!r} does not exist: pass a Hugging Face "
                          "layout directory (config.json + *.safetensors + tokenizer), or "
                          "model=None for the default")
        self.hf_config: PretrainedConfig = AutoConfig.from_pretrained(self.model)
        arch = (getattr(self.hf_config, "architectures", None) or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch} is not supported; use one of "
                             f"{SUPPORTED_ARCHITECTURES}")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', not {self.device!r}")
        self.torch_dtype = self._resolve_dtype()
        self._check_sizes()
        self.trace = self.trace or os.environ.get("NANOSERVE_TRACE", "0") not in ("", "0")

    def _resolve_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            if self.device == "cpu":
                return torch.float32
            cfg = self.hf_config
            dtype = getattr(cfg, "torch_dtype", None) or getattr(cfg, "dtype", None)
            return DTYPES.get(str(dtype).removeprefix("torch."), torch.bfloat16)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {list(DTYPES)}, not {self.dtype!r}")
        return DTYPES[self.dtype]

    def _check_sizes(self) -> None:
        positive = ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                    "tensor_parallel_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        bs = self.kvcache_block_size
        if bs < 1 or bs & (bs - 1):
            raise ValueError(f"kvcache_block_size must be a power of two, got {bs}")
        if self.device == "cuda" and bs < 16:
            raise ValueError(f"kvcache_block_size must be at least 16 on the GPU, got {bs}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        max_pos = getattr(self.hf_config, "max_position_embeddings", self.max_model_len)
        self.max_model_len = min(self.max_model_len, max_pos)
        if self.num_kvcache_blocks is not None:
            self.check_kvcache_fits(self.num_kvcache_blocks)
        self._check_tensor_parallel()

    def _check_tensor_parallel(self) -> None:
        tp, cfg = self.tensor_parallel_size, self.hf_config
        for name in ("num_attention_heads", "num_key_value_heads"):
            if getattr(cfg, name) % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide "
                                 f"{name}={getattr(cfg, name)}; pick a divisor of both head counts")
        # on the CPU a rank is just a process (gloo), so only GPUs bound the size
        num_gpus = torch.cuda.device_count()
        if self.device == "cuda" and tp > num_gpus:
            raise ValueError(f"tensor_parallel_size={tp} exceeds the {num_gpus} visible GPUs; "
                             "lower it or expose more GPUs (CUDA_VISIBLE_DEVICES)")

    def check_kvcache_fits(self, num_blocks: int, block_bytes: int | None = None) -> None:
        """A KV cache must hold one sequence of max_model_len tokens, or requests could hang."""
        needed = cdiv(self.max_model_len, self.kvcache_block_size)
        if num_blocks >= needed:
            return
        missing = ("" if block_bytes is None else
                   f" ({(needed - num_blocks) * block_bytes / 2**30:.2f} GiB missing)")
        raise ValueError(f"the KV cache has {num_blocks} blocks of {self.kvcache_block_size} "
                         f"tokens, but one max_model_len={self.max_model_len} sequence needs "
                         f"{needed}{missing}: lower max_model_len or max_num_batched_tokens, or "
                         "raise gpu_memory_utilization (or num_kvcache_blocks)")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy (argmax); higher = flatter distribution
    top_p: float = 1.0  # keep the fewest likeliest tokens whose probability reaches top_p; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    max_tokens: int = 64  # most tokens to generate
    ignore_eos: bool = False  # True: keep going past EOS (benchmarks)
    stop_token_ids: tuple[int, ...] = ()  # extra tokens that end the sequence ("stop")
    seed: int | None = None  # fixed seed: the request samples the same tokens in any batch

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            if not _is_real(getattr(self, name)):
                raise ValueError(f"{name} must be a real number, got {getattr(self, name)!r}")
        for name in ("top_k", "max_tokens"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.seed is not None and not (_is_int(self.seed) and self.seed >= 0):
            raise ValueError(f"seed must be an integer >= 0 or None, got {self.seed!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not all(
                _is_int(t) for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of integer token ids, got "
                             f"{self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
