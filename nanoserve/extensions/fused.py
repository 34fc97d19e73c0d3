"""Fused kernels: norm + rotary + KV store in one Triton kernel, compiled ops and sampler.

On the GPU and under TRITON_INTERPRET=1, with `fused_kernels=True` (the default).

A layer's plain steps before attention are five launches (two norms, two rotations, the store):
one Triton launch does them all, rotating q and k in place, with two programs per token (q's
heads; k's heads and the store) to halve each program's chain of loads. The remaining elementwise
chains (add + RMSNorm, SiLU-and-mul, prefill's gather of keys, dequantizing an fp8 cache) go
through torch.compile, which fuses each chain into one kernel: a launch and a round trip through
memory saved per op. The sampler (kernels.sampling: noise hash, temperature, race) compiles the
same way, into one pass over the logits. Plugs in at the backends (`backends`); the plain steps
in kernels.rotary, kernels.sampling and layers are what every kernel here must match
(tests/fused_ref.py, tests/test_sampler.py).
"""
import dataclasses
import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from nanoserve import kernels, layers
from nanoserve.config import Config

COMPILED = ("rms_norm", "silu_and_mul", "sample")  # the backends' plain steps torch.compile fuses


def gpu_compiled(fn: Callable) -> Callable:
    """torch.compile fuses a chain of elementwise ops into one kernel. One compile serves every
    batch: dim 0 of each tensor (the tokens) is a variable, every other size a constant. Compiled
    with all sizes variables (`dynamic=True`), SiLU-and-mul takes its row length as an argument
    and runs slower (docs/performance.md). CPU tensors run the plain function."""
    compiled = torch.compile(fn)

    @functools.wraps(fn)
    def dispatch(x: Tensor, *args: object) -> object:
        for t in filter(torch.is_tensor, (x, *args)):
            torch._dynamo.maybe_mark_dynamic(t, 0)  # "maybe": weights keep their sizes
        return compiled(x, *args) if x.is_cuda else fn(x, *args)
    return dispatch


def fused_norm_rotary_store(positions: Tensor, q: Tensor, k: Tensor, v: Tensor,
                            attn: layers.Attention, rotary: layers.RotaryEmbedding,
                            q_norm: layers.RMSNorm | None,
                            k_norm: layers.RMSNorm | None) -> tuple[Tensor, Tensor]:
    """layers.norm_rotary_store as one Triton kernel: one launch per layer instead of five."""
    norm = None if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
    return rotary_and_store(q, k, v, positions, rotary.cos_sin, attn.k_cache, attn.v_cache,
                            layers.get_forward_context().slot_mapping, norm)


@functools.cache  # one compile per process: each new wrapper would compile again
def compiled_steps() -> dict[str, Callable]:
    """Each elementwise step compiled into one kernel: the backends' and prefill's gather."""
    # each dtype and model shape compiles a step again; past dynamo's limit (8: several engines
    # in one process) it would run the step eagerly, with other bits than the compiled one's
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return {name: gpu_compiled(getattr(layers.Backends(), name)) for name in COMPILED} | {
        "gather_kv": gpu_compiled(kernels.gather_kv)}


def backends(chosen: layers.Backends, config: Config) -> layers.Backends:
    """The fused steps: every elementwise step compiled (prefill's gather + dequantize in one
    pass, say), but norm + rotary + store, one Triton kernel."""
    compiled = compiled_steps()
    return dataclasses.replace(
        chosen, rms_norm=compiled["rms_norm"], silu_and_mul=compiled["silu_and_mul"],
        sample=compiled["sample"], norm_rotary_store=fused_norm_rotary_store,
        prefill_attention=functools.partial(layers.varlen_prefill, gather_kv=compiled["gather_kv"]))


@triton.jit
def _norm_rotate_heads(x_ptr, weight_ptr, cos, sin, eps, NUM_HEADS: tl.constexpr,
                       HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr):
    """One token's heads (NUM_HEADS, D) at x_ptr rotated in place, RMS-normalized first with
    QK_NORM; returns the rotated halves. Rotate-half layout: x[i] pairs with x[i + D/2] under angle
    i; cos, sin (1, D/2) fp32."""
    heads, half = tl.arange(0, HEADS_PAD)[:, None], tl.arange(0, HEAD_DIM // 2)[None, :]
    # (HEADS_PAD, D/2), spelled out in full (& half >= 0): Triton's interpreter does not broadcast
    # store masks. Heads pad to a power of two: SmolLM2's 9 query heads to 16.
    mask = (heads < NUM_HEADS) & (half >= 0)
    lo_ptr = x_ptr + heads * HEAD_DIM + half  # (HEADS_PAD, D/2) pointers to the first halves
    dtype = x_ptr.dtype.element_ty
    x1 = tl.load(lo_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo_ptr + HEAD_DIM // 2, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:  # rounded as rms_norm_ref rounds: normalized in fp32, to the dtype, times weight
        # (HEADS_PAD, 1): one inverse RMS per head, over both halves
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(weight_ptr + half).to(tl.float32)  # (1, D/2)
        w2 = tl.load(weight_ptr + HEAD_DIM // 2 + half).to(tl.float32)
        x1 = ((x1 * inv_rms).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * inv_rms).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    y1, y2 = (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)
    tl.store(lo_ptr, y1, mask=mask)
    tl.store(lo_ptr + HEAD_DIM // 2, y2, mask=mask)
    return y1, y2


@triton.jit
def _rotary_store_kernel(q_ptr, k_ptr, v_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr,
                         k_weight_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, q_stride,
                         k_stride, v_stride, eps, H: tl.constexpr, H_PAD: tl.constexpr,
                         HKV: tl.constexpr, HKV_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         QK_NORM: tl.constexpr, STORE: tl.constexpr):
    # program (token, 0) rotates the token's q heads; (token, 1) its k heads, and stores k and v
    token, part = tl.program_id(0), tl.program_id(1)
    half = tl.arange(0, HEAD_DIM // 2)[None, :]  # (1, D/2)
    # the position's row of the table: D/2 cosines, then D/2 sines
    angles = cos_sin_ptr + tl.load(positions_ptr + token) * HEAD_DIM
    cos, sin = tl.load(angles + half), tl.load(angles + HEAD_DIM // 2 + half)
    if part == 0:
        _norm_rotate_heads(q_ptr + token * q_stride, q_weight_ptr, cos, sin, eps, H, H_PAD,
                           HEAD_DIM, QK_NORM)
    else:
        heads = tl.arange(0, HKV_PAD)[:, None]
        slot = tl.load(slot_mapping_ptr + token) if STORE else -1
        # slot -1 (a padded graph row) or no cache yet: no heads, no loads or stores of v
        mask = (heads < tl.where(slot >= 0, HKV, 0)) & (half >= 0)
        # v's loads are issued first, and are in flight while k's heads are rotated
        src = v_ptr + token * v_stride + heads * HEAD_DIM + half
        v1, v2 = tl.load(src, mask=mask), tl.load(src + HEAD_DIM // 2, mask=mask)
        k1, k2 = _norm_rotate_heads(k_ptr + token * k_stride, k_weight_ptr, cos, sin, eps, HKV,
                                    HKV_PAD, HEAD_DIM, QK_NORM)
        # the cache holds the rotated keys; an fp8 cache rounds them and v to e4m3 in the store's
        # cast (nearest even, saturating at +-448): scale 1, as store_kvcache_ref does
        dst = slot.to(tl.int64) * (HKV * HEAD_DIM) + heads * HEAD_DIM + half  # one cache row
        tl.store(k_cache_ptr + dst, k1, mask=mask)
        tl.store(k_cache_ptr + dst + HEAD_DIM // 2, k2, mask=mask)
        tl.store(v_cache_ptr + dst, v1, mask=mask)
        tl.store(v_cache_ptr + dst + HEAD_DIM // 2, v2, mask=mask)


def rotary_and_store(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin: Tensor,
                     k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                     qk_norm: tuple[Tensor, Tensor, float] | None = None) -> tuple[Tensor, Tensor]:
    """Rotary embedding of q (N, H, D) and k (N, Hkv, D) at positions (N,), after a per-head RMSNorm
    of each when qk_norm = (q_weight (D,), k_weight (D,), eps) is given (Qwen3); then the rotated k
    and v (N, Hkv, D) go into the paged caches at slot_mapping (N,) int32 (slot -1 writes nowhere;
    empty caches, before the KV cache exists, skip the store). cos_sin (max_position, D) fp32: each
    position's D/2 cosines, then its D/2 sines. q, k, v may be views of one fused projection (heads
    packed, any token stride). Returns the rotated q and k: with Triton, q and k themselves, rotated
    in place by one launch; otherwise new tensors (the reference)."""
    (N, H, D), Hkv = q.shape, k.shape[1]
    assert k.shape == v.shape == (N, Hkv, D) and positions.shape == slot_mapping.shape == (N,)
    assert all(t.stride()[1:] == (D, 1) for t in (q, k, v)), "heads packed, last dim contiguous"
    assert D >= 4 and D & (D - 1) == 0, f"head dim {D}: the Triton kernels need a power of two"
    assert cos_sin.dtype == torch.float32 and cos_sin.shape[1] == D and cos_sin.is_contiguous()
    store = k_cache.numel() > 0
    assert not store or (k_cache.shape[2:] == (Hkv, D) and k_cache.shape == v_cache.shape
                         and k_cache.is_contiguous() and v_cache.is_contiguous()
                         and k_cache.dtype in (k.dtype, torch.float8_e4m3fn)
                         and slot_mapping.dtype == torch.int32)
    q_weight, k_weight, eps = qk_norm or (q, k, 0.0)  # without the norm the weights are never read
    _rotary_store_kernel[(N, 2)](  # two programs per token: q's heads, k's and the store
        q, k, v, positions, cos_sin, q_weight, k_weight, k_cache if store else k,
        v_cache if store else v, slot_mapping, q.stride(0), k.stride(0), v.stride(0), eps, H=H,
        H_PAD=triton.next_power_of_2(H), HKV=Hkv, HKV_PAD=triton.next_power_of_2(Hkv), HEAD_DIM=D,
        QK_NORM=qk_norm is not None, STORE=store)
    return q, k
