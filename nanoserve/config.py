"""Engine settings (Config) and per-request settings (SamplingParams), validated on construction.

Owns: every knob a user can turn, with its unit and effect, and the checks that reject bad values
with a message naming the fix. Does not own: the model itself (models.py) or any tensor.
Invariant: after LLM start-up a Config is read-only, except `num_kvcache_blocks`, which is only
known after the model runner has measured free memory and is filled in once.
Called by: llm_engine (builds both), scheduler, block_manager and model_runner (read them).
"""
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from types import ModuleType

import torch
from transformers import AutoConfig, PretrainedConfig

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, without floats: how many b-sized pieces hold a."""
    return -(-a // b)


def extension(name: str) -> ModuleType:
    """Import nanoserve.extensions.<name>, which a setting switched on. The core imports an
    extension here only, and only when asked: without the folder the core still runs."""
    try:
        return importlib.import_module(f"nanoserve.extensions.{name}")
    except ModuleNotFoundError as e:
        if e.name not in ("nanoserve.extensions", f"nanoserve.extensions.{name}"):
            raise  # the extension is there, something it imports is not
        raise ValueError(f"the extension {name!r} is not installed (no nanoserve/extensions/"
                         f"{name}.py): switch off the setting that asks for it") from None


# a table row per check: (field, is the value valid?, what a valid value is), so errors name the fix
Check = tuple[str, Callable[..., bool], str]


def check_fields(obj: object, checks: tuple[Check, ...]) -> None:
    """Raise a ValueError for the first field of obj whose value fails its check. A field typed
    bool takes True or False only: a string such as "no" would count as true."""
    flags = [(f.name, lambda v: type(v) is bool, "a bool") for f in fields(obj) if f.type is bool]
    for name, is_valid, must_be in (*flags, *checks):
        if not is_valid(value := getattr(obj, name)):
            raise ValueError(f"{name} must be {must_be}, got {value!r}")


def _is_a(x: object, types: type | tuple[type, ...]) -> bool:
    """isinstance, but a bool is no number here (True is an int to Python)."""
    return isinstance(x, types) and not isinstance(x, bool)


# Config fields that count something (sequences, tokens, ranks): each at least 1
SIZES = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "tensor_parallel_size",
         "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "kvcache_block_size")
# the checks of Config's fields that hold on any machine (the GPU and the checkpoint add more)
CONFIG_CHECKS: tuple[Check, ...] = (
    *((name, lambda v: _is_a(v, int) and v >= 1, "an integer >= 1") for name in SIZES),
    ("kvcache_block_size", lambda v: not v & (v - 1), "a power of two"),  # (and >= 1: SIZES)
    ("gpu_memory_utilization", lambda v: _is_a(v, (int, float)) and 0 < v <= 1, "in (0, 1]"),
    ("dtype", lambda v: v == "auto" or v in DTYPES, f"'auto' or one of {list(DTYPES)}"),
    ("device", lambda v: v in ("auto", "cuda", "cpu"), "'auto', 'cuda' or 'cpu'"),
    ("kv_cache_dtype", lambda v: v in ("auto", "fp8"), "'auto' (the model's dtype) or 'fp8'"),
    ("speculative_method", lambda v: v in (None, "ngram"), "None (off) or 'ngram'"),
)


@dataclass
class Config:
    model: str  # Hugging Face layout directory: config.json, *.safetensors, tokenizer files
    max_num_seqs: int = 512  # most sequences in one batch (prefill or decode)
    max_num_batched_tokens: int = 16384  # tokens of one prefill step; longer prompts are chunked
    max_model_len: int = 4096  # most tokens (prompt + output) of one sequence
    gpu_memory_utilization: float = 0.9  # share of GPU memory for weights + KV + activations
    tensor_parallel_size: int = 1  # ranks; each holds 1/tp of the heads and of the MLP
    enforce_eager: bool = False  # True: no CUDA graphs (decode steps eager, prefill_graphs off)
    kvcache_block_size: int = 16  # tokens per KV block (the paging unit)
    num_kvcache_blocks: int | None = None  # None: sized from free memory; an int overrides
    enable_prefix_caching: bool = True  # reuse KV blocks of equal prompt prefixes across requests
    overlap_scheduling: bool = True  # launch the next step while this one runs (one rank only)
    cascade_attention: bool = True  # GPU decode: split-KV, and a shared prefix read once
    fused_kernels: bool = True  # GPU: norm + rotary + KV store in one kernel, compiled elementwise
    prefill_graphs: bool = True  # GPU, one rank: a lone prompt's prefill replays a CUDA graph
    dtype: str = "auto"  # "auto": 16-bit on GPU (bf16 for a float32 checkpoint), float32 on CPU
    device: str = "auto"  # "auto": "cuda" when available, else "cpu"
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8": float8 e4m3, half the bytes
    speculative_method: str | None = None  # "ngram": propose tokens by prompt lookup, verify
    num_speculative_tokens: int = 8  # most tokens proposed per sequence and step
    prompt_lookup_min: int = 2  # the shortest n-gram the lookup matches (a suffix this long)
    prompt_lookup_max: int = 4  # the longest: of the matches found, the longest wins
    batch_invariant: bool = False  # GPU: a request's tokens and logprobs the same in any batch
    trace: bool = False  # log one line per engine step (also NANOSERVE_TRACE=1)
    timeline: bool = False  # record every step for a picture of the run (LLM.timeline.plot)

    def __post_init__(self) -> None:
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"{self.model!r} is no model directory (it has no config.json): pass "
                             "a Hugging Face layout directory (config.json + *.safetensors + "
                             "tokenizer), or model=None for the default")
        self.hf_config: PretrainedConfig = AutoConfig.from_pretrained(self.model)
        arch = (getattr(self.hf_config, "architectures", None) or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch} is not supported; use one of "
                             f"{SUPPORTED_ARCHITECTURES}")
        check_fields(self, CONFIG_CHECKS)
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        # the decode kernel's tl.dot (tensor cores) needs at least 16 rows per block
        check_fields(self, (("kvcache_block_size", lambda v: self.device != "cuda" or v >= 16,
                             "at least 16 on the GPU"),))
        self.torch_dtype = self._resolve_dtype()
        self.max_model_len = min(self.max_model_len, getattr(
            self.hf_config, "max_position_embeddings", self.max_model_len))
        if self.num_kvcache_blocks is not None:
            self.check_kvcache_fits(self.num_kvcache_blocks)
        self._check_tensor_parallel()
        self.trace = self.trace or os.environ.get("NANOSERVE_TRACE", "0") not in ("", "0")

    def _resolve_dtype(self) -> torch.dtype:
        """`dtype` as a torch.dtype. "auto" is float32 on the CPU; on a GPU a float16 checkpoint
        runs in float16 and any other (float32 too, as vLLM's "auto") in bfloat16, or in float16
        where the GPU has no bfloat16. dtype="float32" still runs a GPU in float32."""
        if self.dtype != "auto" or self.device == "cpu":
            return DTYPES.get(self.dtype, torch.float32)  # "auto" on the CPU: float32
        fp16 = str(self.hf_config.dtype).removeprefix("torch.") == "float16"
        return torch.float16 if fp16 or not torch.cuda.is_bf16_supported() else torch.bfloat16

    def _check_tensor_parallel(self) -> None:
        tp, cfg = self.tensor_parallel_size, self.hf_config
        for name in ("num_attention_heads", "num_key_value_heads"):
            if getattr(cfg, name) % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide "
                                 f"{name}={getattr(cfg, name)}; pick a divisor of both head counts")
        # on the CPU a rank is just a process (gloo), so only GPUs bound the size
        if self.device == "cuda" and tp > (num_gpus := torch.cuda.device_count()):
            raise ValueError(f"device='cuda', tensor_parallel_size={tp}: {num_gpus} GPUs are "
                             "visible; lower it, expose more (CUDA_VISIBLE_DEVICES) or use 'cpu'")

    def check_kvcache_fits(self, num_blocks: int, block_bytes: int | None = None) -> None:
        """A KV cache must hold one sequence of max_model_len tokens, or requests could hang."""
        needed = cdiv(self.max_model_len, self.kvcache_block_size)
        if num_blocks < needed:
            missing = ("" if block_bytes is None else
                       f" ({(needed - num_blocks) * block_bytes / 2**30:.2f} GiB missing)")
            raise ValueError(f"the KV cache has {num_blocks} blocks of {self.kvcache_block_size} "
                             f"tokens, but one max_model_len={self.max_model_len} sequence needs "
                             f"{needed}{missing}: lower max_model_len or max_num_batched_tokens, "
                             "or raise gpu_memory_utilization (or num_kvcache_blocks)")


MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs

# `v >= 0` is also False for NaN; a str is iterable but is not a list of token ids
SAMPLING_CHECKS: tuple[Check, ...] = (
    ("temperature", lambda v: _is_a(v, (int, float)) and v >= 0, "a real number >= 0 (0 = greedy)"),
    ("top_p", lambda v: _is_a(v, (int, float)) and 0 < v <= 1, "a real number in (0, 1] (1 = off)"),
    ("top_k", lambda v: _is_a(v, int) and v >= 0, "an integer >= 0 (0 = off)"),
    *((f, lambda v: _is_a(v, int) and v >= 1, "an integer >= 1") for f in ("max_tokens", "n")),
    ("seed", lambda v: v is None or (_is_a(v, int) and v >= 0), "an integer >= 0 or None"),
    ("stop_token_ids", lambda v: isinstance(v, (list, tuple)) and all(_is_a(t, int) for t in v),
     "a list of integer token ids"),
    ("stop", lambda v: isinstance(v, (list, tuple)) and all(isinstance(t, str) and t for t in v),
     "a list of non-empty strings"),
    ("logprobs", lambda v: v is None or (_is_a(v, int) and 0 <= v <= MAX_LOGPROBS),
     f"None or an integer in [0, {MAX_LOGPROBS}]"),
    ("guided_decoding", lambda v: v is None or hasattr(v, "source"), "a GuidedDecodingParams"),
    ("best_of", lambda v: v is None or (_is_a(v, int) and v >= 1), "None or an integer >= n"),
)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy (argmax); higher = flatter distribution
    top_p: float = 1.0  # keep the fewest likeliest tokens whose probability reaches top_p; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    max_tokens: int = 64  # most tokens to generate
    ignore_eos: bool = False  # True: keep going past EOS (benchmarks)
    stop_token_ids: tuple[int, ...] = ()  # extra tokens that end the sequence ("stop")
    seed: int | None = None  # fixed seed: the request samples the same tokens in any batch
    stop: tuple[str, ...] = ()  # strings that end the sequence, matched on the text, left out of it
    logprobs: int | None = None  # k: each output token's log-probability and the k likeliest's
    guided_decoding: object = None  # a GuidedDecodingParams (extensions.guided): its constraint
    n: int = 1  # samples of the prompt to return (extensions.samples)
    best_of: int | None = None  # samples to run, of which the n likeliest are returned

    def __post_init__(self) -> None:
        check_fields(self, SAMPLING_CHECKS)
        for name in ("stop_token_ids", "stop"):  # lists given: frozen as tuples
            object.__setattr__(self, name, tuple(getattr(self, name)))
