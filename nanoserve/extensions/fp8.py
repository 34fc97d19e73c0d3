"""The FP8 KV cache: K and V as float8 e4m3, half the bytes of bf16.

`kv_cache_dtype="fp8"` stores K and V as float8 e4m3, so twice the tokens fit and decode reads
half the bytes.

K and V are stored as they are (per-tensor scale 1, as vLLM's default), rounded to 3 mantissa
bits, saturating at +-448 (kernels.to_cache_dtype). The core's kernels read any cache dtype and
dequantize in registers; this extension chooses the dtype in the backends (the model runner
allocates the cache in it) and checks the GPU can convert it. docs/fp8_cache.md measures the
values' range, the accuracy and the speed.
"""
import dataclasses

import torch

from nanoserve.config import Config
from nanoserve.layers import Backends


def backends(chosen: Backends, config: Config) -> Backends:
    # e4m3 conversions in hardware: compute capability 8.9 (Ada), Hopper and newer
    if config.device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        raise ValueError("kv_cache_dtype='fp8' needs a GPU of compute capability 8.9 or newer "
                         "(Ada, Hopper): use kv_cache_dtype='auto' on this one")
    return dataclasses.replace(chosen, kv_cache_dtype=torch.float8_e4m3fn)
