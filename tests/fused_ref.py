"""The fused norm + rotary + KV store kernel's plain-torch oracle (extensions/fused.py): the core's
steps one by one, with a store that, unlike the core's, leaves slot -1 unwritten."""
from torch import Tensor

from nanoserve.kernels import rms_norm_ref, rotary_ref, to_cache_dtype


def rotary_and_store_ref(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin: Tensor,
                         k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                         qk_norm: tuple[Tensor, Tensor, float] | None = None
                         ) -> tuple[Tensor, Tensor]:
    """Plain-torch rotary_and_store (the test oracle): new q and k, inputs untouched."""
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    angles = cos_sin[positions]  # (N, D)
    q, k = rotary_ref(q, angles), rotary_ref(k, angles)
    if k_cache.numel():
        store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping)
    return q, k



def store_kvcache_ref(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                      slot_mapping: Tensor) -> None:
    """Write key/value (N, Hkv, D) into the caches at slot_mapping (N,); slot -1 writes nowhere.
    Boolean masking syncs: the test oracle only, never in a CUDA graph."""
    N, Hkv, D = key.shape
    assert value.shape == key.shape and k_cache.shape[2:] == (Hkv, D) and slot_mapping.shape == (N,)
    keep = slot_mapping >= 0  # (N,) drop padded slots (-1)
    slots = slot_mapping[keep].long()
    # (num_blocks * B, Hkv, D): slot rows (an indexed assignment: CPU index_copy_ has no fp8)
    k_cache.view(-1, Hkv, D)[slots] = to_cache_dtype(key[keep], k_cache.dtype)
    v_cache.view(-1, Hkv, D)[slots] = to_cache_dtype(value[keep], v_cache.dtype)
