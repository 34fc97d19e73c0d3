"""The plain steps of a layer's attention input: RMSNorm, rotary embedding, the paged KV store.

Plain torch, run on every device by the core; extensions.fused replaces norm + rotary + store by
one Triton kernel and checks it against these. Invariant: slot = block_id * B + offset; the store
never syncs with the host, so a decode step can be a CUDA graph: a padded graph row's slot -1
lands, as Python indexing has it, in the cache's last slot, which the model runner keeps in a
spare block that no sequence owns. The cache is (num_blocks, B, Hkv, D), in the model's dtype or
a float8 one (the store rounds to it).
"""

import torch
from torch import Tensor


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim: the mean of squares in fp32, then back to x's dtype, as
    transformers does."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rotary_ref(x: Tensor, cos_sin: Tensor) -> Tensor:
    """Rotate each (x1, x2) half-pair of x (N, heads, D) by its token's angle; cos_sin (N, D) fp32.
    """
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # (N, 1, D/2) each
    x1, x2 = x.float().chunk(2, dim=-1)  # (N, heads, D/2) each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


def to_cache_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in the cache's dtype, saturated at its largest value as the GPU's conversion does (older
    torch casts to float8 give NaN past 480; e4m3's largest value is 448), scale 1."""
    if x.dtype == dtype:
        return x
    largest = torch.finfo(dtype).max
    return x.clamp(-largest, largest).to(dtype)


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
             slot_mapping: Tensor) -> None:
    """Write key/value (N, Hkv, D) into the caches at slot_mapping (N,) int32, rounded to the
    cache's dtype. An indexed assignment: no mask, so no host sync (slot -1: the spare slot)."""
    N, Hkv, D = key.shape
    assert value.shape == key.shape and k_cache.shape[2:] == (Hkv, D) and slot_mapping.shape == (N,)
    # (num_blocks * B, Hkv, D): one row per slot
    k_cache.view(-1, Hkv, D)[slot_mapping.long()] = to_cache_dtype(key, k_cache.dtype)
    v_cache.view(-1, Hkv, D)[slot_mapping.long()] = to_cache_dtype(value, v_cache.dtype)
