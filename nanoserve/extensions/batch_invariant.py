"""Batch invariance: on the GPU, a request's tokens and logprobs are the same bits in any batch.

What it changes: every step whose order of additions followed the batch. 16-bit products run through
cuBLASLt with a workspace too small to split K and no reduced-precision reduction, float32 ones
through a Triton kernel of one tile shape, and the first product of each weight shape checks it at 1
to 4,096 rows. RMSNorm is one Triton program a row. Prefill and decode attention are one Triton
kernel with no split-KV: a query token's row reads the same key tiles, in the same order, with the
same arithmetic, whether it is in a prompt's chunk, a lone decode or a speculative draft, so
preemption, prefix hits, any chunk size and speculation give the same bits (vLLM's and SGLang's
deterministic modes; docs/performance.md, section 9, with its cost). Where it plugs in, with
`batch_invariant=True`: the backends (`backends`): products, RMSNorms and both attentions (fused's
other steps, a program a row or an element, stay); cascade attention and prefill graphs stay off. On
the CPU nothing changes: float32 there is batch invariant already.
"""
import dataclasses
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from nanoserve import kernels, layers
from nanoserve.config import Config
from nanoserve.kernels.decode import LOG2E, MIN_GROUP_ROWS
from nanoserve.layers import Backends, ForwardContext

TILE_TOKENS = 64  # keys per loop step (whole blocks), as the core's decode kernel
NUM_STAGES = 3  # software pipelining: the next steps' loads fly during this one
# cuBLAS reads these once per process, at its first handle: a workspace too small for split-K
CUBLAS_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}
CHECK_ROWS = (1, 2, 3, 7, 16, 100, 256, 1000, 4096)  # batch row counts the check tries
checked: set[tuple] = set()  # the (weight shape, dtype, bias?) whose products passed the check


def use_fixed_gemms() -> None:
    """Matrix products with one reduction order for any row count (call before the first)."""
    for name, value in CUBLAS_ENV.items():
        os.environ.setdefault(name, value)
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False


@torch.inference_mode()
def check_gemms(weight: Tensor, bias: Tensor | None) -> None:
    """Raise a RuntimeError unless row 0 of x W^T + b is the same bits at every row count."""
    x = torch.randn(max(CHECK_ROWS), weight.shape[1]).to(weight)  # (rows, in)
    alone = F.linear(x[:1], weight, bias)  # (1, out)
    if bad := [rows for rows in CHECK_ROWS
               if not torch.equal(F.linear(x[:rows], weight, bias)[:1], alone)]:
        raise RuntimeError(f"batch_invariant=True: a product of weight {tuple(weight.shape)} gave "
                           f"row 0 other bits in a batch of {bad[0]} rows (cuBLAS split its "
                           f"sums): start the process with {CUBLAS_ENV} in its environment "
                           "(cuBLAS reads them once)")


@triton.jit
def _linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, x_stride, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # one tile of out (M, N) = x (M, K) W^T (N, K): every row's dot products summed k = 0, 1, ...
    # in fp32 fused multiply-adds, the same order for any M
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols, offs_k = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + rows[:, None] * x_stride + (k + offs_k)[None, :],
                    mask=(rows[:, None] < M) & (k + offs_k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[None, :] * K + (k + offs_k)[:, None],
                    mask=(cols[None, :] < N) & (k + offs_k[:, None] < K), other=0.0)
        acc = tl.dot(x, w, acc, input_precision="ieee")
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc,
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear; in float32 on the GPU a Triton kernel, as cuBLAS's float32 kernels change with
    the row count. 16-bit products go to cuBLASLt, set up by use_fixed_gemms, and the first of
    each weight shape on the GPU checks them (check_gemms)."""
    if x.dtype != torch.float32 or not kernels.use_triton(x):
        if x.is_cuda and (key := (weight.shape, weight.dtype, bias is not None)) not in checked:
            check_gemms(weight, bias)
            checked.add(key)
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])  # (M, K)
    (M, K), N = rows.shape, weight.shape[0]
    out = rows.new_empty(M, N)
    _linear_kernel[(triton.cdiv(M, 64), triton.cdiv(N, 64))](
        rows, weight, out, M, N, K, rows.stride(0), BLOCK_M=64, BLOCK_N=64, BLOCK_K=32)
    return (out if bias is None else out + bias).view(*x.shape[:-1], N)


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, eps, x_stride,
                     HIDDEN: tl.constexpr, HIDDEN_PAD: tl.constexpr, ADD: tl.constexpr):
    # one program per row: the row's sum of squares has one order whatever the batch
    row, offs = tl.program_id(0), tl.arange(0, HIDDEN_PAD)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    if ADD:  # residual = x + residual, rounded to the dtype as the plain add is, then normalized
        x = x + tl.load(residual_ptr + row * HIDDEN + offs, mask=mask, other=0.0)
        tl.store(sum_ptr + row * HIDDEN + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * HIDDEN + offs, (xf * inv_rms).to(x.dtype) * weight, mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor:
    """kernels.rms_norm_ref of x (..., hidden) (of x + residual, returned too), a row a program."""
    rows = x.reshape(-1, x.shape[-1])  # (N, hidden), or (N * heads, D) for Qwen3's q/k norm
    out, total = torch.empty_like(rows), torch.empty_like(rows)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, rows if residual is None else residual, weight, out, total, eps, rows.stride(0),
        HIDDEN=rows.shape[1], HIDDEN_PAD=triton.next_power_of_2(rows.shape[1]),
        ADD=residual is not None)
    return out.view(x.shape) if residual is None else (out, total)


@triton.jit
def _attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr,
                      seq_lens_ptr, out_ptr, qk_scale, q_stride_n, q_stride_h, cache_stride_block,
                      cache_stride_token, block_tables_stride, GROUP: tl.constexpr,
                      GROUP_PAD: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, NUM_STAGES: tl.constexpr):
    # Program (query tile, KV head, sequence): ROWS / GROUP_PAD of the sequence's new tokens x
    # the GROUP query heads of one KV head, one row each, against the sequence's paged keys, tile
    # by tile from key 0. A row's arithmetic does not depend on the other rows: a lone decode
    # token and the same token in a prompt's tile get the same bits.
    q_tile, kv_head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first_q = tl.load(cu_seqlens_q_ptr + seq)
    num_q = tl.load(cu_seqlens_q_ptr + seq + 1) - first_q  # the sequence's new tokens
    offs_r, offs_d, offs_t = tl.arange(0, ROWS), tl.arange(0, HEAD_DIM), tl.arange(0, TILE)
    # (ROWS,) each: row r is query head r % GROUP_PAD of the tile's token r // GROUP_PAD
    token, g = q_tile * (ROWS // GROUP_PAD) + offs_r // GROUP_PAD, offs_r % GROUP_PAD
    live = (token < num_q) & (g < GROUP)
    # causal, bottom-right: new token i of n sees the first seq_len - n + i + 1 keys; a dead row
    # sees key 0, so no row's softmax is empty
    ends = tl.where(live, tl.load(seq_lens_ptr + seq) - num_q + token + 1, 1)  # (ROWS,)
    tile_end = tl.max(tl.where(live, ends, 0), 0)  # the keys this program reads
    q_rows = (first_q + token).to(tl.int64) * q_stride_n + (kv_head * GROUP + g) * q_stride_h
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=live[:, None], other=0.0)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([ROWS], tl.float32)  # running softmax denominator
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)  # running numerator
    # block ids are loaded a step ahead, so each step's K/V addresses are known before it starts
    table = block_tables_ptr + seq * block_tables_stride
    block_id = tl.load(table + offs_t // BLOCK_SIZE, mask=offs_t < tile_end, other=0)  # (TILE,)
    for start in tl.range(0, tile_end, TILE, num_stages=NUM_STAGES):
        key = start + offs_t  # (TILE,) positions in the sequence; slot = block_id * B + key % B
        valid = key < tile_end
        slots = (block_id.to(tl.int64) * cache_stride_block + (key % BLOCK_SIZE)
                 * cache_stride_token + kv_head * HEAD_DIM)  # (TILE,)
        k = tl.load(k_cache_ptr + slots[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + slots[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        k, v = k.to(q.dtype), v.to(q.dtype)  # an fp8 cache's values, exact in q's dtype
        # (ROWS, TILE) fp32 scores, -inf past each row's keys
        s = tl.where(key[None, :] < ends[:, None], tl.dot(q, tl.trans(k)) * qk_scale, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a tile past a row's keys leaves its state as it was, exactly (alpha 1, p 0)
        alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_new))
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc, m_i = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v), m_new
        block_id = tl.load(table + (key + TILE) // BLOCK_SIZE, mask=key + TILE < tile_end, other=0)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_rows = (first_q + token).to(tl.int64) * (tl.num_programs(1) * GROUP) + kv_head * GROUP + g
    tl.store(out_ptr + out_rows[:, None] * HEAD_DIM + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=live[:, None])


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
              cu_seqlens_q: Tensor, seq_lens: Tensor, max_seqlen_q: int, scale: float) -> Tensor:
    """Causal attention of q (N, H, D), sequence s's new tokens rows cu_seqlens_q[s]:[s + 1], over
    its seq_lens[s] keys in the paged cache (num_blocks, B, Hkv, D), bottom-right -> (N, H, D)."""
    (N, H, D), (B, Hkv) = q.shape, k_cache.shape[1:3]
    assert q.stride(2) == 1 and block_tables.stride(1) == 1 and k_cache.is_contiguous()
    group_pad = triton.next_power_of_2(H // Hkv)
    queries = max(1, MIN_GROUP_ROWS // group_pad)  # rows = queries x group_pad: tl.dot's 16
    out = q.new_empty(N, H, D)  # (N, H, D)
    _attention_kernel[(triton.cdiv(max_seqlen_q, queries), Hkv, len(seq_lens))](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        GROUP=H // Hkv, GROUP_PAD=group_pad, ROWS=queries * group_pad, HEAD_DIM=D, BLOCK_SIZE=B,
        TILE=TILE_TOKENS, NUM_STAGES=NUM_STAGES)
    return out


def prefill(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
            ctx: ForwardContext, scale: float) -> Tensor:
    """The prefill backend: the prompt's tokens read their keys from the cache as decode does."""
    if not k_cache.numel():  # the profiling run, before the cache exists
        return layers.varlen_prefill(q, k, v, k_cache, v_cache, ctx, scale)
    return attention(q, k_cache, v_cache, ctx.block_tables, ctx.cu_seqlens_q,
                     ctx.cu_seqlens_k.diff().int(), ctx.max_seqlen_q, scale)  # keys (S,)


def decode(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
           ctx: ForwardContext, scale: float) -> Tensor:
    """The decode backend: each row is a sequence of one new token (no host sync: graph safe)."""
    rows = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)  # (S+1,)
    return attention(q, k_cache, v_cache, ctx.block_tables, rows, ctx.context_lens, 1, scale)


def backends(chosen: Backends, config: Config) -> Backends:
    """The products, RMSNorms and both attentions here; the other steps as chosen before (fused's
    or the plain ones, each a program a row or an element). Before the model's first product."""
    if config.device == "cuda":
        use_fixed_gemms()
    return dataclasses.replace(chosen, rms_norm=rms_norm, linear=linear, prefill_attention=prefill,
                               decode_attention=decode)
