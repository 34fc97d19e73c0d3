"""Paged decode: one new query token per sequence attends to its context in the paged KV cache.

Owns the core decode kernel and, for the CPU, plain torch over each row's gathered context
(tests/decode_ref.py holds the kernel's plain-torch oracle). Program (KV head,
sequence) walks the sequence's blocks with an online softmax for the GROUP = H // Hkv query heads
of that KV head, so K/V are read once per group. Invariant: no host sync, a
grid from shapes only (CUDA-graph safe). Called by layers.Attention; extensions/cascade.py builds
split-KV and cascade attention on _attend_tile. KV cache: (num_blocks, B, Hkv, D), slot = block_id
* B + offset, in the model's dtype or fp8 e4m3 (dequantized in registers).
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from nanoserve.kernels.common import use_triton

LOG2E = 1.4426950408889634  # exp(x) == exp2(x * log2(e)); exp2 is one instruction on the GPU
TILE_TOKENS = 64  # K/V rows per loop step, whole blocks: more bytes in flight per program
TILE_TOKENS_FP8 = 128  # an fp8 cache's rows are half the bytes: twice the rows, same bytes
FP8_V_SCALE = 1.0  # an fp8 cache holds K and V as they are: per-tensor scale 1 (see model_runner)
NUM_STAGES = 2  # software pipelining: the next step's loads fly during this one (Triton's 4 warps)
MIN_GROUP_ROWS = 16  # tl.dot (tensor cores) needs >= 16 rows: the GQA group is padded up to this


@triton.jit
def _dot_dtype(q, k_cache_ptr):
    """q in the dtype of the tile products. With an fp8 (e4m3) cache they run in fp16: every e4m3
    value is exact in fp16, Hopper converts a pair of them in one instruction, and a bf16 query
    loses nothing in fp16 (more mantissa bits; its values are far inside fp16's range)."""
    return q.to(tl.float16) if k_cache_ptr.dtype.element_ty == tl.float8e4nv else q


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_id, offset, valid, head_base,
                 offs_d, cache_stride_block, cache_stride_token, qk_scale, v_scale):
    """One online-softmax step of q (ROWS, D) over a tile of cached tokens, at (block_id, offset)
    (TILE,) each; returns the new (m_i, l_i, acc)."""
    rows = block_id.to(tl.int64) * cache_stride_block + offset * cache_stride_token + head_base
    # issue K and V loads together: more bytes in flight per program hides HBM latency
    k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv:  # dequantized in registers, to q's fp16
        # V times its scale, a run-time value: the multiply also makes Triton widen V before the
        # shared-memory stage that transposes V for p @ v, where ldmatrix.trans moves 16-bit
        # values (e4m3 ones would be read back one byte at a time: docs/fp8_cache.md)
        k, v = k.to(q.dtype), v.to(q.dtype) * tl.cast(v_scale, q.dtype)
    # (ROWS, TILE) fp32 scores, the scale folded with log2(e); invalid tokens -inf
    s = tl.where(valid[None, :], tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
    # Online softmax: every tile has >= 1 valid token (it starts below block_end): m_new is finite.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old max
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)  # (ROWS, D) fp32 accumulation
    return m_new, l_i, acc


@triton.jit
def _paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                         out_ptr, qk_scale, v_scale, q_stride_s, q_stride_h, cache_stride_block,
                         cache_stride_token, block_tables_stride, GROUP: tl.constexpr,
                         GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         TILE: tl.constexpr, NUM_STAGES: tl.constexpr):
    # KV heads vary fastest in the grid: a sequence's programs run together, and a batch sorted
    # longest context first (the scheduler's order) starts its longest work first
    kv_head, seq = tl.program_id(0), tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    offs_g, offs_d, offs_t = tl.arange(0, GROUP_PAD), tl.arange(0, HEAD_DIM), tl.arange(0, TILE)
    heads = kv_head * GROUP + offs_g  # (GROUP_PAD,) query heads of this KV head: one K/V read
    # Padded to >= 16 rows so both products run on tensor cores (tl.dot); the extra rows are zeros
    # and their math is free in a memory-bound kernel.
    q = _dot_dtype(tl.load(q_ptr + seq * q_stride_s + heads[:, None] * q_stride_h + offs_d[None, :],
                           mask=offs_g[:, None] < GROUP, other=0.0), k_cache_ptr)  # (GROUP_PAD, D)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of scores (log2 units)
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running softmax denominator
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)  # running numerator
    # TILE tokens per step, each looking up its own block; with TILE a multiple of B (the default
    # tiles, B <= 64) a step reads whole blocks
    for start in tl.range(0, context_len, TILE, num_stages=NUM_STAGES):
        token = start + offs_t  # (TILE,) positions in the sequence
        valid = token < context_len  # the ragged last block; never read table entries past it
        block_id = tl.load(block_tables_ptr + seq * block_tables_stride + token // BLOCK_SIZE,
                           mask=valid, other=0)  # (TILE,) slot = block_id * B + token % B
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_id,
                                     token % BLOCK_SIZE, valid, kv_head * HEAD_DIM, offs_d,
                                     cache_stride_block, cache_stride_token, qk_scale, v_scale)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # context_len 0: zeros, not NaN
    rows = seq * tl.num_programs(0) * GROUP + heads  # (GROUP_PAD,) rows of out (S * H, D)
    tl.store(out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=offs_g[:, None] < GROUP)


def _check_decode_inputs(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                         context_lens: Tensor) -> None:
    """paged_decode's input contract (see its docstring); an AssertionError names the broken one."""
    (S, H, D), (B, Hkv) = q.shape, k_cache.shape[1:3]
    assert H % Hkv == 0 and k_cache.shape[3] == D and v_cache.shape == k_cache.shape
    assert D >= 16 and D & (D - 1) == 0 and B >= 16 and B & (B - 1) == 0, "power-of-two D, B >= 16"
    assert block_tables.shape[0] == S and block_tables.stride(1) == 1 and q.stride(2) == 1
    assert block_tables.dtype == context_lens.dtype == torch.int32 and context_lens.shape == (S,)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()


def paged_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                 context_lens: Tensor, scale: float) -> Tensor:
    """One new query token per sequence attends to its whole paged context: (S, H, D) -> (S, H, D).

    k_cache / v_cache (num_blocks, B, Hkv, D) contiguous; q may be a strided view (last dim
    contiguous); block_tables (S, max_blocks) int32, context_lens (S,) int32 (0: a padded graph
    row, zeros out). D and B powers of two >= 16. Output in q's dtype; fp32 accumulation (fp32
    inputs run the products in TF32). No host sync, grid from shapes only: safe in a CUDA graph.
    """
    (S, H, D), (B, Hkv) = q.shape, k_cache.shape[1:3]
    if not use_triton(q):  # the CPU: each row's context gathered, SDPA over it
        pos = torch.arange(triton.cdiv(int(context_lens.max()), B) * B)  # (L,) every key's place
        slots = block_tables[:, pos // B].clamp(min=0).long() * B + pos % B  # (S, L)
        # (S, Hkv, L, D); slots past a context hold finite values (the cache starts zeroed)
        k, v = (c.view(-1, Hkv, D)[slots].float().transpose(1, 2) for c in (k_cache, v_cache))
        mask = (pos < context_lens[:, None])[:, None, None]  # (S, 1, 1, L)
        out = F.scaled_dot_product_attention(q.float().unsqueeze(2), k, v, attn_mask=mask,
                                             scale=scale, enable_gqa=True)  # empty rows: NaN
        return out.squeeze(2).to(q.dtype)  # (S, H, 1, D) -> (S, H, D)
    _check_decode_inputs(q, k_cache, v_cache, block_tables, context_lens)
    out = q.new_empty(S, H, D)  # (S, H, D)
    tile = TILE_TOKENS_FP8 if k_cache.dtype == torch.float8_e4m3fn else TILE_TOKENS
    _paged_decode_kernel[(Hkv, S)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale * LOG2E, FP8_V_SCALE,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        GROUP=H // Hkv, GROUP_PAD=max(MIN_GROUP_ROWS, triton.next_power_of_2(H // Hkv)),
        HEAD_DIM=D, BLOCK_SIZE=B, TILE=tile, NUM_STAGES=NUM_STAGES)
    return out
