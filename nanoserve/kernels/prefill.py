"""Prefill attention: packed variable-length causal attention over new tokens and cached context.

Owns no Triton kernel: on the GPU it calls FlashAttention (flash-attn when installed, else torch's
built-in FlashAttention-2); on the CPU, and as the test oracle, prefill_attention_ref. No paging:
a prefill first gathers every key's K/V from the cache, prefix-cache hits and new tokens alike
(gather_kv, at the slots the model runner lists once per step). Invariant: the causal mask is
aligned bottom-right, so query i of a sequence is its token Lk - Lq + i. Called by
layers.Attention.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

try:  # optional dependency: the fastest varlen prefill when installed
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                      max_seqlen_q: int, max_seqlen_k: int, scale: float) -> Tensor:
    """Causal varlen attention, q (Nq, H, D), k/v (Nk, Hkv, D) -> (Nq, H, D); mask bottom-right."""
    assert q.shape[1] % k.shape[1] == 0 and k.shape == v.shape and q.shape[2] == k.shape[2]
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return prefill_attention_ref(*args, scale)
    if flash_attn_varlen_func is not None:  # flash-attn's causal mask is bottom-right (>= 2.1)
        return flash_attn_varlen_func(*args, softmax_scale=scale, causal=True)
    # torch's built-in FlashAttention-2: packed varlen, GQA, bottom-right causal; it returns
    # (out, lse, ...): [0] is out (Nq, H, D)
    return torch.ops.aten._flash_attention_forward(*args, 0.0, True, False, scale=scale)[0]


def prefill_attention_ref(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                          cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                          scale: float) -> Tensor:
    """torch SDPA per sequence with an explicit bottom-right causal mask (CPU path, test oracle)."""
    out = torch.empty_like(q)  # (Nq, H, D)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:]):  # one sequence
        Lq, Lk = q1 - q0, k1 - k0
        # bottom-right: query i is token Lk - Lq + i of the sequence (the first Lk - Lq are cached)
        mask = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril(diagonal=Lk - Lq)
        out[q0:q1] = F.scaled_dot_product_attention(  # (H, Lq, D) -> (Lq, H, D)
            q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1)
    return out


def gather_kv(k_cache: Tensor, v_cache: Tensor, slots: Tensor,
              dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """K and V (Nk, Hkv, D) of the cache slots (Nk,) in dtype (the queries'): a prefill's whole
    context, packed. An fp8 cache is dequantized by the cast (scale 1)."""
    # (num_blocks * B, Hkv, D): one row per slot
    return k_cache.flatten(0, 1)[slots].to(dtype), v_cache.flatten(0, 1)[slots].to(dtype)
